"""Tiny random mlx-lm checkpoints with awkward shapes, written with mlx-lm's own classes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes, quantize_model


def write_tiny_model(
    folder: Path,
    config: dict[str, Any],
    tokenizer_from: Path,
    dtype: mx.Dtype = mx.float32,
    seed: int = 0,
    quantize: dict[str, Any] | None = None,
) -> Path:
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
        model, config = quantize_model(
            model,
            config,
            quantize["group_size"],
            quantize["bits"],
            mode=quantize.get("mode", "affine"),
        )
    weights = {
        k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
        for k, v in tree_flatten(model.parameters())
    }
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config))
    shutil.copy(tokenizer_from / "tokenizer_config.json", folder / "tokenizer_config.json")
    write_tokenizer(
        folder / "tokenizer.json",
        tokenizer_from / "tokenizer.json",
        config.get("vocab_size") or config["text_config"]["vocab_size"],
    )
    return folder


def write_tokenizer(path: Path, source: Path, vocab_size: int) -> None:
    """The source BPE tokenizer, cut to its first ``vocab_size`` ids if it has more.

    Keeping the merges whose parts and result all survive is still a valid BPE over every byte
    (byte-level tokens come first), so any text encodes to ids below ``vocab_size``: tiny
    models get a tiny embedding.
    """
    tokenizer = json.loads(source.read_text())
    bpe = tokenizer["model"]
    if len(bpe["vocab"]) > vocab_size:
        vocab = {token: i for token, i in bpe["vocab"].items() if i < vocab_size}
        bpe["vocab"] = vocab
        bpe["merges"] = [m for m in bpe["merges"] if all(t in vocab for t in (*m, "".join(m)))]
        tokenizer["added_tokens"] = [t for t in tokenizer["added_tokens"] if t["id"] < vocab_size]
    path.write_text(json.dumps(tokenizer))
