"""Tiny random mlx-lm checkpoints with awkward shapes, written with mlx-lm's own classes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes, quantize_model


def write_tiny_model(folder: Path, config: dict[str, Any], tokenizer_from: Path,
                     dtype: mx.Dtype = mx.float32, seed: int = 0,
                     quantize: dict[str, Any] | None = None) -> Path:
    """Random weights for ``config`` (scaled so activations stay O(1)), plus a real tokenizer.

    ``quantize`` ({"group_size": g, "bits": b, optional "mode"}) quantizes with mlx-lm's own
    quantize_model, so per-layer choices (e.g. 8-bit group-64 MoE routers) and the config are
    what mlx-lm writes; modules whose input width is not a multiple of g stay float.
    """
    folder.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    params = {}
    for name, value in tree_flatten(model.parameters()):
        if name.endswith("norm.weight"):
            params[name] = 1.0 + 0.1 * mx.random.normal(value.shape)
        else:
            params[name] = 0.08 * mx.random.normal(value.shape)
    model.load_weights(list(params.items()))
    if quantize:
        model, config = quantize_model(model, config, quantize["group_size"], quantize["bits"],
                                       mode=quantize.get("mode", "affine"))
    weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
               for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, folder / name)
    return folder
