"""Sets of indices along one axis as sorted, disjoint, half-open ranges (pure).

Every set here is normalized: ranges sorted, non-empty, not touching (adjacent ranges merge), so
two equal sets have equal tuples.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Iterable, Sequence

Range = tuple[int, int]
Ranges = tuple[Range, ...]


def normalize(ranges: Iterable[Range]) -> Ranges:
    """The union of ``ranges`` (any order, overlaps and repeats allowed)."""
    out: list[list[int]] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)


def union(a: Ranges, b: Ranges) -> Ranges:
    return normalize((*a, *b))


def intersect(a: Ranges, b: Ranges) -> Ranges:
    out: list[Range] = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tuple(out)


def subtract(a: Ranges, b: Ranges) -> Ranges:
    """Indices of ``a`` not in ``b``."""
    out: list[Range] = []
    j = 0
    for start, stop in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k, pos = j, start
        while k < len(b) and b[k][0] < stop:
            if b[k][0] > pos:
                out.append((pos, b[k][0]))
            pos = max(pos, b[k][1])
            k += 1
        if pos < stop:
            out.append((pos, stop))
    return tuple(out)


def length(ranges: Ranges) -> int:
    return sum(b - a for a, b in ranges)


def covers(outer: Ranges, inner: Ranges) -> bool:
    return not subtract(inner, outer)


def split_at(ranges: Ranges, cuts: Sequence[int]) -> Ranges:
    """``ranges`` cut at every point of the sorted ``cuts`` that falls strictly inside one of
    them (the result is not normalized: the pieces touch)."""
    out: list[Range] = []
    for start, stop in ranges:
        inner = cuts[bisect_right(cuts, start) : bisect_left(cuts, stop)]
        bounds = [start, *inner, stop]
        out += list(zip(bounds, bounds[1:], strict=False))
    return tuple(out)
