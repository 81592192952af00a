"""Qwen 2 (dense): Llama's split."""

from __future__ import annotations

from exo_tp.arch.families.llama import LLAMA_LIKE
from exo_tp.arch.family import Family
from exo_tp.frozen import replace

# Qwen2 (dense and MoE) derives head_dim as hidden_size // heads whatever config.json says.
QWEN2 = replace(LLAMA_LIKE, model_types=("qwen2",), reads_head_dim=False)

FAMILY = Family(tables=(QWEN2,))
