"""Seconds of one decode matvec by its shape, from the shapes a device was measured at (pure).

A device does not read every weight byte at one speed: on the 2-core x86 box with OpenBLAS,
one core reads a 576 -> 1152 float32 matrix at 1.1e-10 s/byte and a 576 -> 1248 one at 2.3e-10,
and 1536 -> 576 at 0.9e-10 (docs/benchmarks.md, "Where the remaining error comes from"). A
single per-byte score, the mean over a few shapes, then prices a tensor-parallel shard's
smaller matrices as if they were the whole model's. `exo-tp bench --model M` times the
model's own matrices at a few fractions of each split dimension; `MatvecTable` prices any
other size of them by interpolating along the dimension that differs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Literal

from pydantic import Field

from exo_tp.plan.spec import Frozen

Segment = Literal["attention", "ffn", "head"]  # the parts of a token between TP collectives
# How far past a measured curve's end a shape is still priced from it (a ratio of the varying
# dimension): the bench's eighths cover a split down to an eighth, and a shape far from any
# measured one reads no more like it than like the decode score's mean.
MAX_EXTRAPOLATION = 2.0


class Matrix(Frozen):
    """``count`` weight matrices of one shape a rank reads per decoded token: ``x @ W.T``
    with W stored (n, k), ``bytes`` for all of them as stored."""

    segment: Segment
    k: int = Field(ge=0)
    n: int = Field(ge=0)
    count: int = Field(ge=0)
    bytes: int = Field(ge=0)


class MatvecPoint(Frozen):
    k: int = Field(gt=0)
    n: int = Field(gt=0)
    seconds: float = Field(gt=0)  # one product, weights streamed from memory


Curve = list[tuple[int, float]]  # (the varying dimension, seconds), sorted


def _interpolate(curve: Curve, x: int) -> float | None:
    """Seconds at ``x`` between two measured points of ``curve`` (None: outside it)."""
    for (x0, s0), (x1, s1) in zip(curve, curve[1:], strict=False):
        if x0 <= x <= x1:
            return s0 + (s1 - s0) * (x - x0) / (x1 - x0)
    return None


def _extrapolate(curve: Curve, x: int) -> tuple[float, float]:
    """(distance as a log ratio, seconds) from the end of ``curve`` nearer ``x``, at that end's
    seconds per byte."""
    end = curve[0] if x < curve[0][0] else curve[-1]
    return abs(math.log(x / end[0])), end[1] * x / end[0]


class MatvecTable(Frozen):
    """Measured matvec shapes of one weight format on one device."""

    points: tuple[MatvecPoint, ...] = ()

    @classmethod
    def of(cls, measured: Iterable[tuple[int, int, float]]) -> MatvecTable:
        return cls(points=tuple(MatvecPoint(k=k, n=n, seconds=s) for k, n, s in measured))

    def scaled(self, factor: float) -> MatvecTable:
        """The same shapes ``factor`` times slower (a device measured slower while serving)."""
        return MatvecTable(
            points=tuple(p.model_copy(update={"seconds": p.seconds * factor}) for p in self.points)
        )

    def _curves(self, k: int, n: int) -> list[tuple[Curve, int]]:
        """The measured shapes sharing ``k`` (varying n) and sharing ``n`` (varying k), each
        with where the query lies on it."""
        along_n = sorted((p.n, p.seconds) for p in self.points if p.k == k)
        along_k = sorted((p.k, p.seconds) for p in self.points if p.n == n)
        return [(c, x) for c, x in ((along_n, n), (along_k, k)) if c]

    def seconds(self, k: int, n: int) -> float | None:
        """Seconds of one (k -> n) product: measured, interpolated along a measured curve
        through it, else scaled per byte from the nearest end of one within
        MAX_EXTRAPOLATION; None if there is none (priced by the decode score then)."""
        if k <= 0 or n <= 0:
            return 0.0
        curves = self._curves(k, n)
        for curve, x in curves:
            exact = curve[0][1] if curve[0][0] == x else None
            inside = _interpolate(curve, x) if len(curve) > 1 else exact
            if inside is not None:
                return inside
        if not curves:
            return None
        distance, seconds = min(_extrapolate(curve, x) for curve, x in curves)
        return seconds if distance <= math.log(MAX_EXTRAPOLATION) + 1e-9 else None


def matrices_seconds(
    matrices: Sequence[Matrix], table: MatvecTable, seconds_per_byte: float
) -> float:
    """Seconds to read ``matrices``: by shape where ``table`` knows it, else by bytes."""
    total = 0.0
    for m in matrices:
        one = table.seconds(m.k, m.n) if table.points and m.count else None
        total += m.count * one if one is not None else m.bytes * seconds_per_byte
    return total
