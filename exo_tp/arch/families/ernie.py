"""ERNIE 4.5 MoE."""

from __future__ import annotations

from exo_tp.arch.families._rules import (
    ATTENTION,
    DEEPSEEK_MOE,
    DEEPSEEK_MOE_BRANCHES,
    HEAD_COUNTS,
    attention,
)
from exo_tp.arch.family import Family
from exo_tp.arch.table import ArchTable

# ERNIE 4.5 MoE: llama attention; MoE layers (every moe_layer_interval-th from
# moe_layer_start_index) hold a softmax/sigmoid router (replicated: every rank must route alike),
# stacked routed experts and an ungated shared-expert MLP, summed before the one all-reduce
# (the DeepSeek-style MoE block's split).
ERNIE45_MOE = ArchTable(
    model_types=("ernie4_5_moe",),
    linears=(*attention(), *DEEPSEEK_MOE),
    branches=(ATTENTION, *DEEPSEEK_MOE_BRANCHES),
    replicated=("mlp.gate",),
    counts=HEAD_COUNTS,
    stages=True,
)

FAMILY = Family(tables=(ERNIE45_MOE,))
