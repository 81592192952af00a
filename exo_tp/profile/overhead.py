"""What one decoder layer costs per token beyond its weight reads, on this device.

A decode step builds and evaluates a graph of a few dozen small operations per layer (norms,
rope, attention over the cache, the gated MLP's element-wise products, the residual adds),
each dispatched on its own: on a CPU that is tens of microseconds per layer whatever the weight
sizes, and no tensor-parallel split divides it, since every rank runs every operation of its
layers. It is timed here on a real mlx-lm llama block so small (hidden 64) that its weights read
in no time: what remains is the per-layer cost the cost model adds to the weight reads.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache
from mlx_lm.models.llama import ModelArgs, TransformerBlock

from exo_tp.profile.timing import mean_seconds

LAYERS = 8  # a stack, so one evaluation per token as in a real forward
CONTEXT = 64  # tokens already cached: attention over a short context, as the lab decodes


def _args() -> ModelArgs:
    return ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=LAYERS,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=256,
    )


def layer_overhead_seconds(min_seconds: float) -> float:
    """Mean seconds one tiny layer adds to one decoded token (float32, batch 1)."""
    args = _args()
    blocks = [TransformerBlock(args) for _ in range(LAYERS)]
    mx.eval([b.parameters() for b in blocks])
    caches = [KVCache() for _ in range(LAYERS)]
    h = mx.random.normal((1, CONTEXT, args.hidden_size))
    for block, cache in zip(blocks, caches, strict=True):
        # mlx-lm annotates mask as an array, and takes "causal" too (its models pass it)
        h = block(h, mask="causal", cache=cache)  # type: ignore[arg-type]
    mx.eval(h)
    x = mx.random.normal((1, 1, args.hidden_size))
    mx.eval(x)

    def step() -> None:
        y = x
        for block, cache in zip(blocks, caches, strict=True):
            y = block(y, cache=cache)
            # Keep the cache at the same length: each step decodes "the next token" again.
            cache.offset -= 1
        mx.eval(y)

    return mean_seconds(step, min_seconds) / LAYERS
