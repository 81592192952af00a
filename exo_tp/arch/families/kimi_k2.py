"""Kimi K2 and K2.5: DeepSeek V3 (K2.5 inside a multimodal wrapper)."""

from __future__ import annotations

from exo_tp.arch.families._rules import LANGUAGE_MODEL
from exo_tp.arch.families.deepseek import DEEPSEEK
from exo_tp.arch.family import Family
from exo_tp.frozen import replace

# Kimi K2 (and K2 Thinking): DeepSeek V3 under another model type (mlx-lm remaps it).
KIMI_K2 = replace(DEEPSEEK, model_types=("kimi_k2",))

# Kimi K2.5: a DeepSeek V3 text model nested in a multimodal wrapper (the vision tower is
# dropped by mlx-lm's sanitize), so every path starts at language_model.
KIMI_K25 = replace(DEEPSEEK, model_types=("kimi_k25",), **LANGUAGE_MODEL)

FAMILY = Family(tables=(KIMI_K2, KIMI_K25))
