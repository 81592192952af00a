"""Ministral 3: Llama-4 style query scaling, optional sliding layers; Mistral 3 (its vision
checkpoints) nesting it."""

from __future__ import annotations

from exo_tp.arch.dims import Dim
from exo_tp.arch.families._rules import (
    ATTENTION,
    HEAD_COUNTS,
    LANGUAGE_MODEL,
    MLP,
    attention,
    glu,
)
from exo_tp.arch.family import Family
from exo_tp.arch.table import ArchTable
from exo_tp.frozen import replace

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

# Mistral 3 with its Pixtral tower (Ministral 3, Mistral Small 3.1/3.2): mlx-lm's mistral3 runs
# its text model (ministral3, or llama for a "mistral" text config: the same split, no fused
# block) under language_model, the tower dropped by its sanitize; untied unless the text config
# says otherwise.
MISTRAL3 = replace(MINISTRAL3, model_types=("mistral3",), tie_default=False, **LANGUAGE_MODEL)

FAMILY = Family(tables=(MINISTRAL3, MISTRAL3))
