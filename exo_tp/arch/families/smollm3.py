"""SmolLM3: Llama with rotary embeddings off in some layers."""

from __future__ import annotations

from exo_tp.arch.families.llama import LLAMA_LIKE
from exo_tp.arch.family import Family
from exo_tp.frozen import replace

# SmolLM3: llama with rotary embeddings switched off in every no_rope_layer_interval-th layer
# (per layer, so any head split keeps it).
SMOLLM3 = replace(LLAMA_LIKE, model_types=("smollm3",))

FAMILY = Family(tables=(SMOLLM3,))
