"""Qwen2-MoE: routed experts and a gated shared expert."""

from __future__ import annotations

from exo_tp.arch.dims import Dim
from exo_tp.arch.families._rules import ATTENTION, EXPERTS, HEAD_COUNTS, MLP, attention, glu
from exo_tp.arch.family import Family
from exo_tp.arch.table import ArchTable, BranchRule

# Qwen2-MoE: routed experts plus a sigmoid-gated shared expert, summed before the all-reduce.
QWEN2_MOE = ArchTable(
    model_types=("qwen2_moe",),
    linears=(
        *attention(),
        *glu("mlp.switch_mlp", Dim.EXPERT_FFN),
        *glu("mlp.shared_expert", Dim.SHARED_EXPERT_FFN),
    ),
    branches=(
        ATTENTION,
        MLP,
        EXPERTS,
        BranchRule(path="mlp.shared_expert", kind="mlp", reduce=False),
    ),
    replicated=("mlp.gate", "mlp.shared_expert_gate"),
    counts=HEAD_COUNTS,
    tie_default=False,
    reads_head_dim=False,
    stages=True,
)

FAMILY = Family(tables=(QWEN2_MOE,))
