"""An RMSNorm over the full width of a head-split projection (MiniMax, OLMo 3 q_norm/k_norm).

Each rank holds the weight entries of its heads. The mean square needs every head: each rank
sums the squares of its heads (fp32), one all-reduce adds the ranks' sums, and the total is
divided by the full width (all heads), whatever share this rank holds. KV heads replicated on
several ranks (more ranks than KV heads) are counted once, by their first holder: the others
mask them out of the local sum. A rank holding no heads still joins the all-reduce with zeros
(``join_norm_sum``), or the ring would hang.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from exo_tp.shard.collectives import sum_over_ranks, zeros_after


class ShardedRMSNorm(nn.Module):
    def __init__(
        self,
        weight: mx.array,
        eps: float,
        full_width: int,
        counted: mx.array | None,
        group: mx.distributed.Group,
    ):
        """``weight``: this rank's entries; ``counted``: 1 for each local element whose head
        this rank counts in the sum of squares, 0 for a replica counted elsewhere (None: all)."""
        super().__init__()
        self.weight = weight
        self.eps = eps
        self._full_width = full_width
        self._counted = counted  # underscored: not a parameter (no dtype cast, no training)
        self._group = group

    def __call__(self, x: mx.array) -> mx.array:
        xf = x.astype(mx.float32)
        squares = xf * xf
        if self._counted is not None:
            squares = squares * self._counted
        total = sum_over_ranks(squares.sum(-1, keepdims=True), 1, self._group)
        scale = mx.rsqrt(total / self._full_width + self.eps)
        return (xf * scale * self.weight.astype(mx.float32)).astype(x.dtype)


def join_norm_sum(after: mx.array, group: mx.distributed.Group) -> mx.array:
    """A head-less rank's part of a ShardedRMSNorm: zeros into the same all-reduce (the same
    shape and dtype as a holder's local sum of squares), computed after ``after``."""
    shape = (*after.shape[:-1], 1)
    return sum_over_ranks(zeros_after(shape, mx.float32, after), 1, group)


def counted_mask(slots: tuple[int, ...], earlier: set[int], width: int) -> mx.array | None:
    """1/0 per element of local KV slots ``slots`` (each ``width`` wide): a slot counts if its
    head is in no earlier rank's slots (``earlier``) nor in an earlier slot here. None if all
    count."""
    seen = set(earlier)
    flags = []
    for head in slots:
        flags.append(head not in seen)
        seen.add(head)
    if all(flags):
        return None
    return mx.repeat(mx.array(flags, dtype=mx.float32), width)
