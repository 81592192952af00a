"""Seed-OSS: Llama with optional biases and a head read from the embedding."""

from __future__ import annotations

from exo_tp.arch.dims import Dim
from exo_tp.arch.families._rules import ATTENTION, HEAD_COUNTS, MLP, attention, glu
from exo_tp.arch.family import Family
from exo_tp.arch.table import ArchTable

# Seed-OSS: llama with optional q/k/v, o and MLP biases (row-parallel biases kept by one rank);
# its tied head multiplies by the embedding's weight directly, so the loader gives it a head
# through the vocab-parallel embedding (untie_attr).
SEED_OSS = ArchTable(
    model_types=("seed_oss",),
    linears=(*attention(), *glu("mlp", Dim.FFN)),
    branches=(ATTENTION, MLP),
    counts=HEAD_COUNTS,
    untie_attr="tie_word_embeddings",
    stages=True,
)

FAMILY = Family(tables=(SEED_OSS,))
