"""Tiny random checkpoints that carry MTP (multi-token prediction) heads as the real ones
store them, for the native MTP speculation tests (issue #61).

- Qwen 3.5 / Qwen3-Next: a top-level ``mtp.*`` block (``fc``, ``pre_fc_norm_embedding``,
  ``pre_fc_norm_hidden``, ``layers.0.*`` a full-attention decoder layer, ``norm``), its norms
  zero-centred as Qwen ships them, counted by ``mtp_num_hidden_layers`` in the text config.
- DeepSeek V3 / GLM-5: one more decoder layer after the last, ``model.layers.<N>.*`` (``enorm``,
  ``hnorm``, ``eh_proj``, an MLA attention with its fused ``kv_b_proj``, a MoE with one tensor
  per expert, ``shared_head.norm``), counted by ``num_nextn_predict_layers``.

The heads' parameters are those of mlx-vlm's own drafter classes, written in the checkpoint's
names (exo_tp.finetune.mtp_heads.shipped_heads): mlx-vlm's splitter reads them as it reads a real
checkpoint. ``trained`` copies one and trains its heads on the model's own continuations
(random heads accept no draft).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from arch_configs import tiny_config
from tiny_models import write_tiny_model

from exo_tp.finetune.mtp_heads import add_random_heads, train_heads, untrained_heads


def mtp_config(arch: str) -> dict[str, Any]:
    """The tiny config of ``arch`` declaring one MTP layer."""
    config = tiny_config(arch)
    if "text_config" in config:
        config["text_config"]["mtp_num_hidden_layers"] = 1
    else:
        config["num_nextn_predict_layers"] = 1
    return config


def write_mtp_model(folder: Path, arch: str, tokenizer_from: Path, seed: int = 0) -> Path:
    """A tiny ``arch`` checkpoint (qwen3_5 or glm_moe_dsa) with one MTP layer of random
    weights (seeded)."""
    write_tiny_model(folder, mtp_config(arch), tokenizer_from, seed=seed)
    add_random_heads(folder, seed + 1)
    return folder


def trained(source: Path, folder: Path, prompts: list[list[int]], steps: int) -> Path:
    """A copy of ``source`` whose heads learned the model's greedy continuations of
    ``prompts`` (exo_tp.finetune.mtp_heads)."""
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    train_heads(folder, config, prompts, tokens=48, steps=steps)
    return folder


def _drafter(arch: str, config: dict[str, Any]) -> Any:
    return untrained_heads(config)
