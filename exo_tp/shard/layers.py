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

from exo_tp.shard.collectives import gather_padded, sum_over_ranks


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
    """Stands in for a sub-block (attention, MLP) of which this rank holds nothing.

    It still joins the sub-block's all-reduce, contributing zeros, and keeps a KV cache's
    position in step so masks and rope offsets stay right.
    """

    def __init__(self, width: int, group: mx.distributed.Group):
        super().__init__()
        self._width = width
        self._group = group

    def __call__(self, x: mx.array, *args: Any, cache: Any = None, **kwargs: Any) -> mx.array:
        if cache is None and len(args) >= 2:
            cache = args[1]  # mlx-lm attention: (x, mask, cache)
        if cache is not None and hasattr(cache, "offset"):
            cache.offset += x.shape[1]
        zeros = mx.zeros((*x.shape[:-1], self._width), dtype=x.dtype)
        return sum_over_ranks(zeros, self._width, self._group)


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
            rows = mx.zeros((*ids.shape, self._width), dtype=self._dtype)
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


def _no_logits(x: mx.array) -> mx.array:
    return mx.zeros((*x.shape[:-1], 0), dtype=x.dtype)
