"""A quantized KV cache on a rank's shard: mlx-lm's ``QuantizedKVCache`` per sequence.

mlx-lm quantizes a single sequence's cache in ``generate_step``: after each forward call (a
prefill chunk or a decode step), every layer cache with ``to_quantized`` whose offset reached
``quantized_kv_start`` becomes a ``QuantizedKVCache`` (``maybe_quantize_kv_cache``), and from
then on attention runs through mlx-lm's quantized SDPA. Its batch caches (``BatchKVCache``) have
no quantized form, so a rank with a quantized KV cache runs its batch one sequence at a time
(exo_tp.shard.sequences: each sequence's own caches, its own calls) and applies mlx-lm's own
``maybe_quantize_kv_cache`` to each sequence's caches after each of its calls: every sequence
sees exactly the calls and conversions mlx-lm's single-sequence generation makes, so the result
is mlx-lm's with the same kv_bits, kv_group_size and quantized_kv_start (given the same prefill
chunks). Each rank quantizes the KV of its own heads (groups run along the head width, which
no split cuts).

Which caches can: plain ``KVCache`` layers (quantized) and recurrent ``ArraysCache`` layers
(left as they are, as mlx-lm leaves them). Refused, with the reason: sliding windows
(``RotatingKVCache.to_quantized`` is not implemented in mlx-lm), attention sinks (mlx-lm's
quantized SDPA has none), latent and compressed caches (exo_tp.plan.kv_width), and every other
cache kind.
"""

from __future__ import annotations

from functools import partial

import mlx.nn as nn
from mlx_lm.generate import maybe_quantize_kv_cache
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

from exo_tp.errors import ExoTpError
from exo_tp.shard.sequences import batch_by_sequence

_WHY = {
    "RotatingKVCache": "sliding-window layers (mlx-lm cannot quantize a RotatingKVCache)",
    "ChunkedKVCache": "chunked-attention layers (mlx-lm cannot quantize a ChunkedKVCache)",
    "CacheList": "layers with several caches (mlx-lm cannot quantize a CacheList)",
}


def kv_cache_problem(model: nn.Module) -> str | None:
    """Why this model's caches cannot be quantized (None: they can)."""
    caches = make_prompt_cache(model)
    for cache in caches:
        kind = type(cache).__name__
        if isinstance(cache, ArraysCache) or type(cache) is KVCache:
            continue
        return f"--kv-bits: this model has {_WHY.get(kind, f'{kind} layers (no quantized form)')}"
    if any(_has_sinks(layer) for layer in model.layers):
        return "--kv-bits: this model's attention sinks are not in mlx-lm's quantized attention"
    return None


def _has_sinks(layer: nn.Module) -> bool:
    attention = getattr(layer, "self_attn", None)
    return attention is not None and "sinks" in attention


def quantize_kv(model: nn.Module, bits: int, group_size: int, start: int) -> None:
    """Give ``model`` (in place) a quantized KV cache per sequence, as mlx-lm's generate keeps
    one; raises ExoTpError with the reason when its caches cannot be."""
    problem = kv_cache_problem(model)
    if problem:
        raise ExoTpError(problem)
    convert = partial(
        maybe_quantize_kv_cache,
        quantized_kv_start=start,
        kv_group_size=group_size,
        kv_bits=bits,
    )
    batch_by_sequence(model, after=convert)
