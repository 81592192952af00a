"""Mixtral: a mixture of experts under block_sparse_moe."""

from __future__ import annotations

from exo_tp.arch.dims import Dim
from exo_tp.arch.families._rules import ATTENTION, attention, glu
from exo_tp.arch.family import Family
from exo_tp.arch.table import ArchTable, BranchRule, CountRule

# Mixture of experts: every expert's FFN is split alike (the experts stay stacked), the router
# is replicated, and the whole MoE block is one branch: one all-reduce after the weighted
# expert sum (and after adding the shared experts, where there are any).
MIXTRAL = ArchTable(
    model_types=("mixtral",),
    linears=(*attention(), *glu("block_sparse_moe.switch_mlp", Dim.FFN)),
    branches=(ATTENTION, BranchRule(path="block_sparse_moe", kind="mlp")),
    replicated=("block_sparse_moe.gate",),
    counts=(
        CountRule(path="self_attn.num_heads", dim=Dim.Q_HEADS),
        CountRule(path="self_attn.num_key_value_heads", dim=Dim.KV_HEADS),
    ),
    tie_default=False,
    reads_head_dim=False,
    stages=True,
)

FAMILY = Family(tables=(MIXTRAL,))
