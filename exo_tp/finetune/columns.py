"""Which base linears a fine-tuning job cuts by input columns instead of rows (pure: no MLX).

A serving plan cuts a row-parallel linear (``o_proj``, ``down_proj``) by its input columns, and
so does the weights manifest: its digest blocks run along those columns, all rows each. Cut by
rows for training, such a weight could only be fetched in whole blocks, every row of every
column a node does not hold. Cut by columns at the same block boundaries, a rank's share is whole
blocks, and a node that served the model keeps the columns it holds and fetches only the rest:
the least any cut of its share can move. The gathered weight is the same either way.

A linear is cut by columns when its weight is a matrix cut along its last axis and every
quantization part (scales, biases) is too, at as many points; the points are the storage
indices of the finest cuts any serving plan makes (`exo_tp.weights.layout.split_of`), so the
manifest's blocks and the loader's slices agree by construction. A rank takes a contiguous run
of the intervals between points in proportion to its memory weight; the bias (the full output
width) stays whole on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping

from exo_tp.frozen import Frozen
from exo_tp.plan.shard_plan import Span

COLUMN_PARTS = ("weight", "scales", "biases")


class ColumnCut(Frozen):
    """Storage cut points along the last axis of each part of one linear (as many for each)."""

    points: dict[str, tuple[int, ...]]

    @property
    def units(self) -> int:
        """Intervals between points: the unit a rank's share is counted in."""
        return len(self.points["weight"]) - 1

    def span(self, part: str, units: Span) -> tuple[int, int]:
        """Storage columns [start, stop) of ``part`` for a run of intervals."""
        points = self.points[part]
        return points[units.start], points[units.stop]


def column_cut(parts: Mapping[str, tuple[int, int, tuple[int, ...]]]) -> ColumnCut | None:
    """The cut of a linear from each present part's (ndim, axis, storage points) along the
    axis it may be sliced on; None: cut by rows."""
    if "weight" not in parts:
        return None
    counts = set()
    for key, (ndim, axis, points) in parts.items():
        if key not in COLUMN_PARTS:
            continue
        if ndim != 2 or axis != 1 or len(points) < 2:
            return None
        counts.add(len(points))
    if len(counts) != 1:
        return None
    return ColumnCut(points={k: v[2] for k, v in parts.items() if k in COLUMN_PARTS})
