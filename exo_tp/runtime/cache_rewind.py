"""Taking a verify step's rejected positions back out of a stream's caches.

A KV cache is trimmed: its last positions are simply forgotten. A recurrent state (Gated
DeltaNet's, Mamba's: mlx-lm's ArraysCache) has folded every position into one array and
cannot be trimmed, so it is kept as it was before the verify step and, where positions were
rejected, restored and brought forward again by replaying the kept positions through the
model (every layer: the KV layers are first trimmed back to before the step too). The replay
is one more forward of the kept positions, on every rank alike, only on steps that rejected
a draft. That is how hybrid families (Qwen 3.5, Qwen3-Next, Nemotron-H) speculate at all.
Sliding windows still do not: a step that fills one rotates out what a trim cannot return.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, BatchKVCache, CacheList

# Recurrent states as they were before a verify step: (cache, its state) pairs.
Saved = list[tuple[ArraysCache, Any]]


def made_of(cache: object, kinds: tuple[type, ...]) -> bool:
    """Whether a layer's cache (or each cache of its CacheList) is of one of ``kinds``."""
    return all(isinstance(c, kinds) for c in leaves([cache]))


def rewindable(cache: object) -> bool:
    """A whole-sequence KV cache, a recurrent state, or a list of them."""
    return made_of(cache, (BatchKVCache, ArraysCache))


def save(caches: list[Any]) -> Saved:
    """The recurrent states of ``caches`` (none for a model of KV caches only)."""
    saved: Saved = []
    for cache in leaves(caches):
        if isinstance(cache, ArraysCache):
            data, padding, lengths = cache.state
            # copies: a step changes some of these in place (advance's `-=`)
            state = ([_copy(a) for a in data], _copy(padding), _copy(lengths))
            saved.append((cache, state))
    return saved


def _copy(array: mx.array | None) -> mx.array | None:
    return None if array is None else mx.array(array)


def rewind(model: nn.Module, caches: list[Any], saved: Saved, inputs: mx.array, keep: int) -> None:
    """Leave ``caches`` as if only the first ``keep`` of the step's ``inputs`` (1-D) had
    gone through the model."""
    drop = inputs.shape[0] - keep
    if drop == 0:
        return
    if not saved:
        _trim(caches, drop)
        return
    _trim(caches, inputs.shape[0])
    for cache, state in saved:
        cache.state = state
    if keep:  # computed now, whole: left lazy, each rank would run the replay's collectives
        # whenever its next graph happens to need them, not in step with its peers' (seen:
        # a rank holding none of the recurrent heads needs other parts of it than the rest)
        mx.eval(model(inputs[:keep][None], cache=caches))


def _trim(caches: list[Any], count: int) -> None:
    for cache in leaves(caches):
        if isinstance(cache, BatchKVCache):
            cache.trim(count)


def leaves(caches: list[Any]) -> list[Any]:
    """The caches of a stream's layers, CacheLists opened."""
    out: list[Any] = []
    for cache in caches:
        out.extend(leaves(list(cache.caches)) if isinstance(cache, CacheList) else [cache])
    return out
