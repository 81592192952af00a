"""The vision tower and projector, on the one rank that runs them: mlx-vlm's own model.

mlx-vlm loads the checkpoint lazily (its classes, sanitize and quantization), and its language
model is swapped for a stand-in before anything is read, so only the tower's and projector's
weights load. The stand-in embeds every token as zeros: mlx-vlm's own ``get_input_embeddings``
then returns the image features scattered over the image positions and zeros elsewhere, which is
this rank's extra term of the embedding's all-reduce (exo_tp.vision.registry). A family with
deepstack (Qwen3-VL) also gives the features of some tower blocks, one table per early text layer,
scattered the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from exo_tp.wire.vision import VisionPrompt


class _ZeroEmbedding(nn.Module):
    """The stand-in text model's parts mlx-vlm's merge reads."""

    def __init__(self, width: int, dtype: mx.Dtype):
        super().__init__()
        self._width, self._dtype = width, dtype
        self.embed_scale = 1.0
        self.hidden_size_per_layer_input = 0

    def embed_tokens(self, ids: mx.array) -> mx.array:
        return mx.zeros((*ids.shape, self._width), dtype=self._dtype)


class _NoText(nn.Module):
    def __init__(self, width: int, dtype: mx.Dtype):
        super().__init__()
        self.model = _ZeroEmbedding(width, dtype)

    def embed_tokens(self, ids: mx.array) -> mx.array:  # Kimi K2.5's merge reads it here
        return self.model.embed_tokens(ids)

    def get_rope_index(self, *args: Any, **kwargs: Any) -> tuple[None, None]:
        return None, None  # the API computed the positions; the tower needs none


class Tower:
    def __init__(self, model_dir: Path, width: int, dtype: mx.Dtype):
        from mlx_vlm.utils import load_model

        model = load_model(Path(model_dir), lazy=True)
        del model["language_model"]
        model.language_model = _NoText(width, dtype)
        mx.eval(model.parameters())
        self._model = model
        leaves: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
        self.bytes = sum(value.nbytes for _, value in leaves)

    def features(self, tokens: list[int], vision: VisionPrompt) -> tuple[mx.array, mx.array | None]:
        """(span, hidden): the image features at the span's image positions, zeros elsewhere;
        and with deepstack, (layers, span, hidden): each early text layer's, laid out alike."""
        inputs = {name: mx.array(t.numpy()) for name, t in vision.tower_inputs.items()}
        pixels = inputs.pop("pixel_values")
        ids = mx.array(tokens)[None]
        # Gemma 3's merge reads the processor's attention mask (all ones for one prompt)
        mask = mx.ones(ids.shape, dtype=mx.int32)
        merged = self._model.get_input_embeddings(ids, pixels, mask=mask, **inputs)
        span = vision.span
        rows = merged.inputs_embeds[0, :span]
        deep = getattr(merged, "deepstack_visual_embeds", None)
        if deep is not None:
            # mlx-vlm's rows follow the visual positions in order, all inside the span
            where = np.flatnonzero(np.array(merged.visual_pos_masks[0, :span]))
            layers = mx.zeros((len(deep), span, rows.shape[-1]), dtype=rows.dtype)
            layers[:, mx.array(where)] = mx.stack(list(deep))[:, : len(where)].astype(rows.dtype)
            deep = layers
        mx.eval(rows, deep)
        return rows, deep
