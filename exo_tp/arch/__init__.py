"""Per-architecture tensor-parallel tables (pure data)."""

from exo_tp.arch.table import (
    ArchTable,
    BranchRule,
    CountRule,
    GroupedOutputRule,
    LinearRule,
    NormRule,
    SumRule,
)
from exo_tp.arch.tables import TABLES
from exo_tp.errors import UnsupportedArchitectureError


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(t for table in TABLES for t in table.model_types))


def pipeline_model_types() -> tuple[str, ...]:
    return tuple(sorted(t for table in TABLES if table.stages for t in table.model_types))


def table_for(model_type: str) -> ArchTable:
    for table in TABLES:
        if model_type in table.model_types:
            return table
    raise UnsupportedArchitectureError(
        f"no tensor-parallel table for model type {model_type!r}; "
        f"supported: {', '.join(supported_model_types())}"
    )


__all__ = [
    "ArchTable",
    "BranchRule",
    "CountRule",
    "GroupedOutputRule",
    "LinearRule",
    "NormRule",
    "SumRule",
    "pipeline_model_types",
    "supported_model_types",
    "table_for",
]
