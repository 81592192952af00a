"""Ministral 3: Llama-4 style query scaling, optional sliding layers."""

from __future__ import annotations

from exo_tp.arch.dims import Dim
from exo_tp.arch.families._rules import ATTENTION, HEAD_COUNTS, MLP, attention, glu
from exo_tp.arch.family import Family
from exo_tp.arch.table import ArchTable

# Ministral 3: llama-4 style position-dependent query scaling (computed alike on every rank)
# passed to the attention before the mask and cache (the stand-in finds the cache among the
# arguments), optional sliding layers.
MINISTRAL3 = ArchTable(
    model_types=("ministral3",),
    linears=(*attention(), *glu("mlp", Dim.FFN)),
    branches=(ATTENTION, MLP),
    counts=HEAD_COUNTS,
    stages=True,
)

FAMILY = Family(tables=(MINISTRAL3,))
