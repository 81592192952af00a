"""Qwen3-VL (dense and MoE), text prompts only."""

from __future__ import annotations

from exo_tp.arch.families._rules import LANGUAGE_MODEL
from exo_tp.arch.families.llama import LLAMA_LIKE
from exo_tp.arch.families.qwen3_moe import QWEN3_MOE
from exo_tp.arch.family import Family
from exo_tp.frozen import replace

# Qwen3-VL (dense and MoE) checkpoints, text prompts only: the Qwen3 / Qwen3-MoE text model
# under language_model (mlx-lm drops the vision tower; a text-only prompt's multimodal rotary
# positions are plain 1-D ones), split exactly as those.
# (not fused: its text model sits inside the multimodal wrapper, not tested with one pass)
QWEN3_VL = replace(LLAMA_LIKE, model_types=("qwen3_vl",), fused=None, **LANGUAGE_MODEL, stages=True)
QWEN3_VL_MOE = replace(QWEN3_MOE, model_types=("qwen3_vl_moe",), **LANGUAGE_MODEL, stages=True)

FAMILY = Family(tables=(QWEN3_VL, QWEN3_VL_MOE))
