"""The only doors to MLX collectives: each checks that every rank sends the same shape.

MLX collectives never check shapes: mismatched shapes across ranks give silent garbage, corrupt
the next collective, or hang. Every call here compares the local array with the shape the plan
fixed for all ranks (so equal on every rank by construction) before it communicates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

import mlx.core as mx


class CollectiveShapeError(RuntimeError):
    """A rank was about to send a shape the plan did not agree on (a bug, caught before harm)."""


def _check_last_dim(x: mx.array, expected: int, what: str) -> None:
    if x.shape[-1] != expected:
        raise CollectiveShapeError(f"{what}: last dim {x.shape[-1]} != planned {expected}")


def zeros_after(shape: Sequence[int], dtype: mx.Dtype, after: mx.array) -> mx.array:
    """Zeros that the graph computes only after ``after``.

    Collectives must run in the same order on every rank. A constant input has no place in
    the data flow, so MLX may schedule its collective early and pair it with a peer's other
    collective (same shapes: silent garbage). Tying it to the preceding value keeps order.
    """
    return mx.depends(mx.zeros(shape, dtype=dtype), after)


def sum_over_ranks(x: mx.array, width: int, group: mx.distributed.Group) -> mx.array:
    """All-reduce of a full-width activation (row-parallel partial sums)."""
    _check_last_dim(x, width, "all_sum")
    if group.size() == 1:
        return x
    return mx.distributed.all_sum(x, group=group)


def gather_padded(x: mx.array, sizes: Sequence[int], group: mx.distributed.Group) -> mx.array:
    """Concatenate differently sized last-axis shards from every rank, in rank order.

    Each shard is padded to the largest, all-gathered (equal shapes), and the padding stripped.
    """
    rank = group.rank()
    _check_last_dim(x, sizes[rank], "all_gather shard")
    if group.size() == 1:
        return x
    padded = max(sizes)
    lead = x.shape[:-1]
    rows = math.prod(lead)
    flat = x.reshape(rows, x.shape[-1])  # explicit: -1 is undefined for an empty shard
    if flat.shape[-1] < padded:
        flat = mx.pad(flat, [(0, 0), (0, padded - flat.shape[-1])])
    gathered = mx.distributed.all_gather(flat, group=group).reshape(len(sizes), rows, padded)
    pieces = [gathered[r, :, : sizes[r]] for r in range(len(sizes)) if sizes[r]]
    return mx.concatenate(pieces, axis=-1).reshape(*lead, sum(sizes))


def broadcast_from_first(x: mx.array, group: mx.distributed.Group) -> mx.array:
    """Rank 0's value of ``x`` on every rank (``x`` must have the same shape everywhere)."""
    if group.size() == 1:
        return x
    mine = x if group.rank() == 0 else zeros_after(x.shape, x.dtype, x)
    return mx.distributed.all_sum(mine, group=group)


def gather_rows_padded(
    xs: Sequence[mx.array],
    sizes: Sequence[int] | Sequence[Sequence[int]],
    group: mx.distributed.Group,
    shapes: Sequence[Sequence[int]],
    stream: mx.Stream | None = None,
) -> list[mx.array]:
    """Whole tensors from differently sized dim-0 shards (row runs) on every rank, in rank order.

    ``xs`` are this rank's rows of tensors cut at the same rows (a layer's weight, scales,
    biases, bias), ``shapes`` their whole planned shapes, ``sizes`` every rank's rows (or, a
    list per tensor, each tensor's). They travel as one all-gather: each rank sends its shards'
    bytes back to back (bit-exact, whatever their dtypes), padded to the longest rank's; each
    whole tensor is then assembled from every rank's piece, which strips the padding.
    ``stream`` runs all of it there (a communication stream, to overlap compute).
    """
    rank, n = group.rank(), group.size()
    per_tensor = bool(sizes) and isinstance(sizes[0], Sequence)
    cuts: list[tuple[int, ...]] = (  # (the casts: which of the union `per_tensor` tells)
        [tuple(s) for s in cast(Sequence[Sequence[int]], sizes)]
        if per_tensor
        else [tuple(cast(Sequence[int], sizes))] * len(xs)
    )
    for x, shape, cut in zip(xs, shapes, cuts, strict=True):
        planned = (cut[rank], *shape[1:])
        if len(cut) != n or shape[0] != sum(cut) or tuple(x.shape) != planned:
            raise CollectiveShapeError(
                f"all_gather rows: shape {tuple(x.shape)} != planned "
                f"{planned} of {tuple(shape)} cut {cut}"
            )
    if n == 1:
        return list(xs)
    widths = [math.prod(shape[1:]) * x.dtype.size for x, shape in zip(xs, shapes, strict=True)]
    # bytes per rank per part
    lengths = [[cut[r] * width for cut, width in zip(cuts, widths, strict=True)] for r in range(n)]
    longest = max(sum(per_rank) for per_rank in lengths)
    with mx.stream(stream if stream is not None else mx.default_stream(mx.default_device())):
        mine = [mx.view(x.reshape(x.size), mx.uint8) for x in xs]
        if sum(lengths[rank]) < longest:
            mine.append(mx.zeros((longest - sum(lengths[rank]),), dtype=mx.uint8))
        packed = mine[0] if len(mine) == 1 else mx.concatenate(mine)
        gathered = mx.distributed.all_gather(packed, group=group, stream=stream)
        if len(xs) == 1 and len(set(cuts[0])) == 1:  # one tensor, no padding: already whole
            return [mx.view(gathered, xs[0].dtype).reshape(tuple(shapes[0]))]
        gathered = gathered.reshape(n, longest)
        whole = []
        for p, (x, shape) in enumerate(zip(xs, shapes, strict=True)):
            pieces = []
            for r in range(n):
                start = sum(lengths[r][:p])
                if lengths[r][p]:
                    pieces.append(gathered[r, start : start + lengths[r][p]])
            joined = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces)
            whole.append(mx.view(joined, x.dtype).reshape(tuple(shape)))
        return whole
