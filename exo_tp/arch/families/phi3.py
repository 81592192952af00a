"""Phi-3: packed q|k|v and gate|up projections."""

from __future__ import annotations

from exo_tp.arch.dims import Dim
from exo_tp.arch.families._rules import ATTENTION, HEAD_COUNTS, MLP, col, row
from exo_tp.arch.family import Family
from exo_tp.arch.table import ArchTable

# Phi-3 packs q|k|v and gate|up into one projection each: every packed part is split on its own.
PHI3 = ArchTable(
    model_types=("phi3",),
    linears=(
        col("self_attn.qkv_proj", Dim.Q_HEADS, Dim.KV_HEADS, Dim.KV_HEADS),
        row("self_attn.o_proj", Dim.Q_HEADS),
        col("mlp.gate_up_proj", Dim.FFN, Dim.FFN),
        row("mlp.down_proj", Dim.FFN),
    ),
    branches=(ATTENTION, MLP),
    counts=HEAD_COUNTS,
    tie_default=False,
    reads_head_dim=False,
    stages=True,
)

FAMILY = Family(tables=(PHI3,))
