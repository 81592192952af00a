"""MLX modules that wrap mlx-lm's own layers for uneven tensor parallelism.

Column-parallel layers need no wrapper: they are mlx-lm's Linear / QuantizedLinear holding a
rank's rows. Row-parallel layers sum partial products over ranks (one all-reduce) and add the bias
once. Vocab-parallel embedding and LM head hold a rank's vocabulary rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from exo_tp.shard.collectives import gather_padded, sum_over_ranks, zeros_after


class RowParallel(nn.Module):
    """``inner`` holds this rank's input columns; the all-reduce completes the product."""

    def __init__(self, inner: nn.Module, width: int, bias: mx.array | None,
                 group: mx.distributed.Group):
        super().__init__()
        self.inner = inner
        if bias is not None:
            self.bias = bias
        self._width = width
        self._group = group

    def __call__(self, x: mx.array) -> mx.array:
        y = sum_over_ranks(self.inner(x), self._width, self._group)
        return y + self.bias if "bias" in self else y


class ZeroBranch(nn.Module):
    """Stands in for a sub-block (an MLP) of which this rank holds nothing.

    It still joins the sub-block's all-reduce, contributing zeros.
    """

    def __init__(self, width: int, group: mx.distributed.Group):
        super().__init__()
        self._width = width
        self._group = group

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        zeros = zeros_after((*x.shape[:-1], self._width), x.dtype, x)
        return sum_over_ranks(zeros, self._width, self._group)


class ZeroAttention(ZeroBranch):
    """Stands in for attention on a rank that holds no heads.

    mlx-lm's prefill evaluates only the KV caches, so every rank's caches must depend on the
    layer inputs exactly as a real attention's do: otherwise this rank would skip the prefill
    all-reduces its peers run, and the ring would hang. It therefore caches one head-sized
    slice of its input (a stand-in head: negligible memory, never read).
    """

    def __init__(self, width: int, head_dim: int, group: mx.distributed.Group):
        super().__init__(width, group)
        self._head_dim = head_dim

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None,
                 *args: Any, **kwargs: Any) -> mx.array:
        if cache is not None:
            b, length, _ = x.shape
            stand_in = x[..., : self._head_dim].reshape(b, length, 1, -1).transpose(0, 2, 1, 3)
            cache.update_and_fetch(stand_in, stand_in)
        return super().__call__(x)


class VocabParallelEmbedding(nn.Module):
    """Embedding rows [start, stop) of the vocabulary; lookups are summed over ranks.

    Also serves as the tied LM head through ``as_linear``: local logits for its rows, gathered
    (padded to equal shapes) into the full vocabulary.
    """

    def __init__(self, inner: nn.Module, start: int, sizes: Sequence[int], width: int,
                 dtype: mx.Dtype, group: mx.distributed.Group):
        super().__init__()
        self.inner = inner
        self._start = start
        self._dtype = dtype
        self._sizes = tuple(sizes)
        self._width = width
        self._group = group

    @property
    def _local_size(self) -> int:
        return self._sizes[self._group.rank()]

    def __call__(self, ids: mx.array) -> mx.array:
        local = ids - self._start
        inside = (local >= 0) & (local < self._local_size)
        if self._local_size:
            rows = self.inner(mx.where(inside, local, 0))
            rows = rows * inside[..., None].astype(rows.dtype)
        else:
            rows = zeros_after((*ids.shape, self._width), self._dtype, ids)
        return sum_over_ranks(rows, self._width, self._group)

    def as_linear(self, x: mx.array) -> mx.array:
        local = self.inner.as_linear(x) if self._local_size else _no_logits(x)
        return gather_padded(local, self._sizes, self._group)


class VocabParallelHead(nn.Module):
    """An untied LM head holding rows [start, stop) of the vocabulary."""

    def __init__(self, inner: nn.Module, sizes: Sequence[int], group: mx.distributed.Group):
        super().__init__()
        self.inner = inner
        self._sizes = tuple(sizes)
        self._group = group

    def __call__(self, x: mx.array) -> mx.array:
        local = self.inner(x) if self._sizes[self._group.rank()] else _no_logits(x)
        return gather_padded(local, self._sizes, self._group)


class Absent(nn.Module):
    """A part of the model this pipeline stage does not hold (never called, never loaded)."""

    def __init__(self, what: str):
        super().__init__()
        self._what = what

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        raise RuntimeError(f"{self._what} is held by another pipeline stage")

    def as_linear(self, x: mx.array) -> mx.array:
        return self(x)


def _no_logits(x: mx.array) -> mx.array:
    return zeros_after((*x.shape[:-1], 0), x.dtype, x)
