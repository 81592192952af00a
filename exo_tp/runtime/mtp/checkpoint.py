"""Whether a checkpoint carries MTP heads mlx-vlm can load, their size, and loading them.

The heads are found as mlx-vlm's splitter for the family finds them (its ``select_keys`` over
the checkpoint's tensor names) and loaded by that splitter, so every family mlx-vlm registers
(qwen3_5, qwen3_5_moe, qwen3_next, glm_moe_dsa, deepseek_v4, nemotron_h ...) works alike.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from exo_tp.errors import ExoTpError
from exo_tp.plan.mtp import declared_mtp
from exo_tp.shard.safetensors_slices import SafetensorsIndex


def _config(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    return dict(json.loads(path.read_text())) if path.exists() else {}


def _splitter(config: dict[str, Any]) -> Any | None:
    from mlx_vlm.speculative.drafters.mtp_split import get_mtp_splitter

    try:
        return get_mtp_splitter(source_config=config)
    except (ImportError, ValueError, KeyError):
        return None


def heads_names(model_dir: Path) -> set[str]:
    """The checkpoint's MTP tensors, as mlx-vlm's splitter picks them (none where it carries
    none, declares none, or mlx-vlm has no drafter for its family)."""
    config = _config(model_dir)
    if not declared_mtp(config):
        return set()
    splitter = _splitter(config)
    if splitter is None:
        return set()
    text_config = splitter.read_text_config(config)
    names = SafetensorsIndex(Path(model_dir)).entries
    return {name for name in names if splitter.select_keys(name, text_config)}


def load_heads(model_dir: Path, dtype: mx.Dtype | None) -> nn.Module:
    """mlx-vlm's drafter holding the checkpoint's MTP heads, in ``dtype``, loaded now."""
    config = _config(model_dir)
    splitter = _splitter(config)
    if splitter is None or not heads_names(model_dir):
        raise ExoTpError(f"{model_dir} carries no MTP heads mlx-vlm can load")
    heads = splitter.load(Path(model_dir), source_config=config)
    if dtype is not None:  # (None: the checkpoint's own)
        heads.set_dtype(dtype)
    mx.eval(heads.parameters())
    return heads
