"""Gemma 2 and Gemma 3 (text)."""

from __future__ import annotations

from exo_tp.arch.dims import Dim
from exo_tp.arch.families._rules import (
    ATTENTION,
    HEAD_COUNTS,
    LANGUAGE_MODEL,
    MLP,
    QK_NORMS,
    attention,
    glu,
)
from exo_tp.arch.family import Family
from exo_tp.arch.table import ArchTable, CountRule
from exo_tp.frozen import replace

# Gemma 2/3: the same split; soft-capping of attention scores acts per head, soft-capping of
# the final logits acts on the gathered logits, the embedding scale after the embedding's
# all-reduce, and sliding-window layers keep a RotatingKVCache of the local heads.
GEMMA = ArchTable(
    model_types=("gemma3_text",),
    linears=(*attention(), *glu("mlp", Dim.FFN)),
    branches=(ATTENTION, MLP),
    replicated=QK_NORMS,
    counts=(*HEAD_COUNTS, CountRule(path="self_attn.repeats", dim=Dim.REPEATS)),
)

# Gemma 2 computes its soft-capped scores per KV group (no fused attention): a batched mask
# needs the group axis.
GEMMA2 = replace(GEMMA, model_types=("gemma2",), grouped_scores=True)

# Gemma 3 with its vision tower (mlx-lm's gemma3 wraps gemma3_text under language_model).
GEMMA3 = replace(GEMMA, model_types=("gemma3",), **LANGUAGE_MODEL)

FAMILY = Family(tables=(GEMMA, GEMMA2, GEMMA3))
