"""Mistral 4: DeepSeek V3's MLA with a softmax router."""

from __future__ import annotations

from exo_tp.arch.families.deepseek import DEEPSEEK
from exo_tp.arch.family import Family
from exo_tp.frozen import replace

# Mistral 4: DeepSeek V3's MLA (latent cache replicated, heads split) with a softmax router that
# is a plain Linear ("mlp.gate", replicated); its attention takes the llama-4 query scale as a
# second argument (the zero stand-in finds the cache among the arguments).
MISTRAL4 = replace(DEEPSEEK, model_types=("mistral4",))

FAMILY = Family(tables=(MISTRAL4,))
