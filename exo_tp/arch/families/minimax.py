"""MiniMax (M1/M2): full-width q/k norms, every layer a MoE block."""

from __future__ import annotations

from exo_tp.arch.dims import Dim
from exo_tp.arch.families._rules import (
    ATTENTION,
    ATTENTION_HEAD_COUNTS,
    FULL_WIDTH_QK_NORMS,
    attention,
    glu,
)
from exo_tp.arch.family import Family
from exo_tp.arch.table import ArchTable, BranchRule

# MiniMax (M1/M2): full-width q/k norms (exo_tp.shard.sharded_norm), partial rotary; every
# layer a MoE block with a sigmoid router and a score-correction bias (both replicated: every
# rank routes alike), the experts' FFN split like Mixtral's, one all-reduce after the weighted
# expert sum.
MINIMAX = ArchTable(
    model_types=("minimax",),
    linears=(*attention(), *glu("block_sparse_moe.switch_mlp", Dim.FFN)),
    branches=(ATTENTION, BranchRule(path="block_sparse_moe", kind="mlp")),
    replicated=("block_sparse_moe.gate", "block_sparse_moe.e_score_correction_bias"),
    norms=FULL_WIDTH_QK_NORMS,
    counts=ATTENTION_HEAD_COUNTS,
    tie_default=False,
    stages=True,
)

FAMILY = Family(tables=(MINIMAX,))
