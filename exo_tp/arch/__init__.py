"""Per-architecture tensor-parallel tables (pure data)."""

from exo_tp.arch.dims import Dim
from exo_tp.arch.generic import generic_table
from exo_tp.arch.registry import TABLES
from exo_tp.arch.table import (
    ArchTable,
    BranchRule,
    CountRule,
    GroupedOutputRule,
    LinearRule,
    NormRule,
    SumRule,
)
from exo_tp.errors import UnsupportedArchitectureError


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(t for table in TABLES for t in table.model_types))


def pipeline_model_types() -> tuple[str, ...]:
    return tuple(sorted(t for table in TABLES if table.stages for t in table.model_types))


def table_for(model_type: str) -> ArchTable:
    """The model type's tensor-parallel table; for another mlx-lm model type, a stages-only
    (or whole-on-one-node) table read from mlx-lm's source (exo_tp.arch.generic)."""
    for table in TABLES:
        if model_type in table.model_types:
            return table
    generic = generic_table(model_type)
    if generic is not None:
        return generic
    raise UnsupportedArchitectureError(
        f"mlx-lm has no model type {model_type!r}; tensor-parallel tables: "
        f"{', '.join(supported_model_types())}"
    )


def mode_reason(model_type: str) -> tuple[str, str]:
    """(mode, why): tensor-parallel, pipeline stages only or whole on one node, and why."""
    table = table_for(model_type)
    if table.split:
        return table.mode, f"{model_type} has a tensor-parallel table"
    return table.mode, table.why


__all__ = [
    "ArchTable",
    "BranchRule",
    "CountRule",
    "Dim",
    "GroupedOutputRule",
    "LinearRule",
    "NormRule",
    "SumRule",
    "TABLES",
    "pipeline_model_types",
    "generic_table",
    "mode_reason",
    "supported_model_types",
    "table_for",
]
