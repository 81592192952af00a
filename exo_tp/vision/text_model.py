"""A vision checkpoint's language model on a rank, taught to run registered image spans.

The rank runs mlx-lm's text model of the checkpoint (the tables split it as any model); these
wrappers add what mlx-vlm's merged input brings (exo_tp.vision.registry says how the ids carry
it): the embedding's image rows, the per-layer tables' id 0 at images, M-RoPE's positions, and
for a family whose text model scales its embeddings (Gemma), the scale applied to the token
rows only, before the all-reduce, as mlx-vlm applies it before it scatters the image features;
for deepstack (Qwen3-VL), the tower's rows of each early layer, added where that layer's MLP
is all-reduced. With nothing registered every wrapper runs exactly what it wraps.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from exo_tp.arch import table_for
from exo_tp.errors import ExoTpError
from exo_tp.shard.layers import PartialSum, VocabParallelEmbedding, Wrapper
from exo_tp.shard.tree import get_path, has_path, set_path
from exo_tp.vision.families import VISION_FAMILIES
from exo_tp.vision.registry import VisionRegistry


class VisionEmbedding(nn.Module):
    """The first stage's vocab-parallel embedding over registered spans (module doc)."""

    def __init__(self, inner: VocabParallelEmbedding, registry: VisionRegistry, scale: float):
        super().__init__()
        self.inner = inner
        self._registry = registry
        self._scale = scale

    def __call__(self, ids: mx.array) -> mx.array:
        registry = self._registry
        rows = self.inner.local(registry.real_tokens(ids))
        if self._scale != 1.0:
            rows = rows * self._scale
        if registry.empty:
            return self.inner.reduce(rows)
        rows = mx.where(registry.image_rows(ids)[..., None], mx.zeros((1,), rows.dtype), rows)
        features = registry.features(ids, rows.dtype)
        return self.inner.reduce(rows if features is None else rows + features)

    def as_linear(self, x: mx.array) -> mx.array:
        return self.inner.as_linear(x)


class ImageIdsAsZero(nn.Module):
    """A per-layer vocab table (Gemma 4): registered ids looked up as their token, 0 at images."""

    def __init__(self, inner: nn.Module, registry: VisionRegistry):
        super().__init__()
        self.inner = inner
        self._registry = registry

    def __call__(self, ids: mx.array) -> mx.array:
        return self.inner(self._registry.real_tokens(ids, image_as=0))


class MropeRope(nn.Module):
    """An attention's RoPE: rows holding registered ids take mlx-vlm's M-RoPE at their 3-D
    positions; every other row mlx-lm's own RoPE at the cache offset, as without images."""

    def __init__(self, inner: nn.Module, rotary: Any, registry: VisionRegistry):
        super().__init__()
        self.inner = inner
        self._rotary = rotary
        self._registry = registry

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        plain = self.inner(x, offset=offset)
        ids = self._registry.current_ids
        if self._registry.empty or ids is None or ids.shape[1] != x.shape[2]:
            return plain
        positions, rows = self._registry.positions(ids, offset)
        turned, _ = self._rotary.apply_rotary(x, x, positions, unsqueeze_dim=1)
        return mx.where(rows[:, None, None, None], turned, plain)


class DeepstackRows(Wrapper):
    """The MLP of text layer ``layer`` inside its all-reduce, on the tower's rank: its partial
    sum plus that layer's deepstack rows, so the reduced output carries them once. mlx-vlm adds
    them to the layer's output (its residual sum); adding them inside it is the same sum, in
    another order of float additions."""

    def __init__(self, inner: nn.Module, registry: VisionRegistry, layer: int):
        super().__init__(inner)
        self._registry = registry
        self._layer = layer

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        out = self.inner(x, *args, **kwargs)
        ids = self._registry.current_ids
        if self._registry.empty or ids is None or ids.shape[:2] != x.shape[:2]:
            return out
        rows = self._registry.deepstack(ids, self._layer, out.dtype)
        return out if rows is None else out + rows


class _SeesIds:
    """Mixed into the text stack's class: each forward's ids stay where the RoPE reads them."""

    _vision_registry: VisionRegistry

    def __call__(self, inputs: mx.array, *args: Any, **kwargs: Any) -> Any:
        self._vision_registry.current_ids = inputs
        try:
            return super().__call__(inputs, *args, **kwargs)  # type: ignore[misc]
        finally:
            self._vision_registry.current_ids = None


def _mrope_rotary(config: dict[str, Any]) -> Any:
    """mlx-vlm's own M-RoPE for the text config (Qwen 3.5's interleaved sections)."""
    from mlx_vlm.models.qwen3_5.language import Qwen3_5RotaryEmbedding

    text = config["text_config"]
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    return Qwen3_5RotaryEmbedding(
        int(head_dim * rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0))),
        max_position_embeddings=text.get("max_position_embeddings", 2048),
        base=rope.get("rope_theta", text.get("rope_theta", 10000.0)),
        mrope_section=rope["mrope_section"],
    )


def teach_images(
    model: nn.Module, model_type: str, config: dict[str, Any], registry: VisionRegistry, first: bool
) -> None:
    """Install the wrappers on a loaded shard (every stage: positions; the first: lookups)."""
    family = VISION_FAMILIES[model_type]  # vision_config() admits only these
    table = table_for(model_type)
    stack = get_path(model, table.stack)
    cls = type(stack)
    stack.__class__ = type(cls.__name__, (_SeesIds, cls), {})
    stack._vision_registry = registry
    if first:
        scale = 1.0
        if family.scale_attr is not None:
            scale = float(getattr(stack, family.scale_attr))
            setattr(stack, family.scale_attr, 1.0)  # the wrapper scales the token rows
        embedding = get_path(model, table.embedding)
        set_path(model, table.embedding, VisionEmbedding(embedding, registry, scale))
        for path in table.vocab_tables:
            if has_path(model, path):
                set_path(model, path, ImageIdsAsZero(get_path(model, path), registry))
    if family.deepstack and registry.tower is not None:
        _add_deepstack(get_path(model, table.layers), config, registry)
    if family.mrope:
        rotary = _mrope_rotary(config)
        for block in get_path(model, table.layers):
            attention = getattr(block, "self_attn", None)
            while isinstance(attention, Wrapper):  # the shard's wrappers hold the attention
                attention = attention["inner"]
            if attention is not None and "rope" in attention:
                attention.rope = MropeRope(attention.rope, rotary, registry)


def _add_deepstack(
    layers: list[nn.Module], config: dict[str, Any], registry: VisionRegistry
) -> None:
    """The tower's rank (first stage, so its layers are the model's first): each deepstack
    layer's MLP all-reduce carries that layer's rows (DeepstackRows)."""
    count = len(config["vision_config"].get("deepstack_visual_indexes") or ())
    if count > len(layers):
        raise ExoTpError(
            f"deepstack adds image features after text layers 0-{count - 1}: the first stage "
            f"holds {len(layers)} layers; give it at least {count}"
        )
    for k in range(count):
        mlp = getattr(layers[k], "mlp", None)
        if not isinstance(mlp, PartialSum):
            raise ExoTpError(f"deepstack: text layer {k}'s MLP is not all-reduced on its own")
        mlp.inner = DeepstackRows(mlp["inner"], registry, k)
