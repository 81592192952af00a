"""Qwen3-MoE."""

from __future__ import annotations

from exo_tp.arch.dims import Dim
from exo_tp.arch.families._rules import (
    ATTENTION,
    EXPERTS,
    HEAD_COUNTS,
    MLP,
    QK_NORMS,
    attention,
    glu,
)
from exo_tp.arch.family import Family
from exo_tp.arch.table import ArchTable

# Qwen3-MoE: dense layers ("mlp_only_layers") and MoE layers share the "mlp" path.
QWEN3_MOE = ArchTable(
    model_types=("qwen3_moe",),
    linears=(*attention(), *glu("mlp", Dim.FFN), *glu("mlp.switch_mlp", Dim.EXPERT_FFN)),
    branches=(ATTENTION, MLP, EXPERTS),
    replicated=(*QK_NORMS, "mlp.gate"),
    counts=HEAD_COUNTS,
    stages=True,
)

FAMILY = Family(tables=(QWEN3_MOE,))
