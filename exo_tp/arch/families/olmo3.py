"""OLMo 3: llama-like with full-width q/k norms."""

from __future__ import annotations

from exo_tp.arch.dims import Dim
from exo_tp.arch.families._rules import (
    ATTENTION,
    ATTENTION_HEAD_COUNTS,
    FULL_WIDTH_QK_NORMS,
    MLP,
    attention,
    glu,
)
from exo_tp.arch.family import Family
from exo_tp.arch.table import ArchTable

# OLMo 3: llama-like, with full-width q/k norms (sharded as MiniMax's), post-norms applied to
# each branch's all-reduced output, alternating sliding-window (RotatingKVCache of the local
# heads) and full-attention layers.
OLMO3 = ArchTable(
    model_types=("olmo3",),
    linears=(*attention(), *glu("mlp", Dim.FFN)),
    branches=(ATTENTION, MLP),
    norms=FULL_WIDTH_QK_NORMS,
    counts=ATTENTION_HEAD_COUNTS,
    tie_default=False,
    stages=True,
)

FAMILY = Family(tables=(OLMO3,))
