"""Batching for a model whose caches cannot be batched: one forward pass per sequence.

mlx-lm's batch generator merges the caches of several sequences into batch caches (``merge``,
``filter``, ``extend``, ``extract``; right-padded prompts through ``prepare``/``finalize``).
DeepSeek V4.1's LayerCache has none of these, and its forward pass takes one start position for
the whole batch (a window, compressed groups and an open group per layer, all by position), so
sequences of different lengths cannot share a pass. Here every layer's cache is a
``Sequences`` (the caches of each sequence in the batch: what the generator merges, filters and
extracts) and the model runs each sequence alone over its own real tokens. Every rank runs the
same sequences in the same order with the same lengths (the batch is in lockstep), so their
collectives still pair up. Results equal mlx-lm's single-sequence generation exactly; the cost
is one pass per sequence instead of one per batch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache


def make_prompt_cache_default(model: nn.Module) -> list[Any]:
    """mlx-lm's cache for a model without ``make_cache`` (make_prompt_cache's fallback)."""
    return [KVCache() for _ in model.layers]


class Sequences:
    """One layer's caches of every sequence of a batch, in batch order."""

    def __init__(self, caches: list[Any]):
        self.caches = caches
        # Real tokens each sequence still has in a right-padded prompt (``prepare``), else None.
        self.remaining: list[int] | None = None

    def merge(self, batches: list[Sequences]) -> Sequences:
        return Sequences([c for b in batches for c in b.caches])

    def extend(self, other: Sequences) -> None:
        self.caches.extend(other.caches)

    def filter(self, keep: list[int]) -> None:
        self.caches = [self.caches[i] for i in keep]

    def extract(self, index: int) -> Sequences:
        # a copy, as a batch cache's extract gives: the prompt cache may keep it while the
        # sequence goes on in the batch and its own cache moves on
        return Sequences([copy.deepcopy(self.caches[index])])

    def prepare(self, *, lengths: list[int], right_padding: list[int], **_: Any) -> None:
        self.remaining = list(lengths)

    def finalize(self) -> None:
        self.remaining = None

    @property
    def state(self) -> list[Any]:
        return [c.state for c in self.caches]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)

    def empty(self) -> bool:
        return all(c.empty() for c in self.caches)

    def is_trimmable(self) -> bool:
        return False


# After each sequence's forward call: its caches (one per layer), replaced in place as
# mlx-lm's generate replaces a prompt cache's entries (maybe_quantize_kv_cache).
AfterCall = Callable[[list[Any]], None]


def batch_by_sequence(stack: nn.Module, after: AfterCall | None = None) -> None:
    """Make the model's layer stack ``stack`` (in place; the module whose ``make_cache`` the
    model's calls, and which a pipeline stage before the last runs alone; or the whole model)
    give ``Sequences`` caches and run a batch of them one sequence at a time; called with plain
    caches (mlx-lm's own single-sequence generation) it runs as before. ``after`` runs on each
    sequence's caches after each of its calls (a quantized KV cache: exo_tp.shard.kv_quant)."""
    base = type(stack)

    def base_caches(self: nn.Module) -> list[Any]:
        if hasattr(base, "make_cache"):
            return base.make_cache(self)
        return make_prompt_cache_default(self)

    def make_cache(self: nn.Module) -> list[Sequences]:
        return [Sequences([c]) for c in base_caches(self)]

    def call(self: nn.Module, inputs: mx.array, cache: Any = None, **kwargs: Any) -> mx.array:
        if not cache or not isinstance(cache[0], Sequences):
            return base.__call__(self, inputs, cache=cache, **kwargs)
        length = inputs.shape[1]
        remaining = cache[0].remaining
        outs: list[mx.array | None] = []
        for row in range(inputs.shape[0]):
            # a right-padded prompt: only this sequence's own tokens go through its caches
            real = length if remaining is None else min(length, remaining[row])
            if remaining is not None:
                remaining[row] -= real
            if not real:
                outs.append(None)
                continue
            caches = [layer.caches[row] for layer in cache]
            outs.append(base.__call__(self, inputs[row : row + 1, :real], cache=caches, **kwargs))
            if after is not None:
                after(caches)
                for layer, replaced in zip(cache, caches, strict=True):
                    layer.caches[row] = replaced
        held = [o for o in outs if o is not None]
        if held[0].ndim == 1:  # a stage's messages (exo_tp.shard.streams): back to back
            return mx.concatenate(held)
        padded = [
            mx.zeros((1, length, *held[0].shape[2:]), held[0].dtype)
            if o is None
            else mx.pad(o, [(0, 0), (0, length - o.shape[1])] + [(0, 0)] * (o.ndim - 2))
            for o in outs
        ]
        return mx.concatenate(padded, axis=0)

    stack.__class__ = type(
        base.__name__,
        (base,),
        {"make_cache": make_cache, "__call__": call, "__module__": base.__module__},
    )
