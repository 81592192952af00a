"""Integer shares that track real-valued weights: largest-remainder apportionment."""

from __future__ import annotations

import math
from collections.abc import Sequence

from exo_tp.plan.shard_plan import Span


def normalize(weights: Sequence[float]) -> tuple[float, ...]:
    from exo_tp.errors import PlanError

    if not weights:
        raise PlanError("no ranks to plan for")
    if any(not math.isfinite(w) or w < 0 for w in weights):
        raise PlanError(f"device weights must be finite and non-negative, got {list(weights)}")
    total = sum(weights)
    if total <= 0:
        raise PlanError("at least one device weight must be positive")
    return tuple(w / total for w in weights)


def largest_remainder(units: int, weights: Sequence[float]) -> tuple[int, ...]:
    """Split ``units`` whole units so each share is within one unit of ``units * weight``.

    Ties in the remainders go to the lower rank, so the result is deterministic.
    """
    shares = normalize(weights)
    quotas = [units * s for s in shares]
    counts = [math.floor(q) for q in quotas]
    leftover = units - sum(counts)
    order = sorted(range(len(shares)), key=lambda r: (-(quotas[r] - counts[r]), r))
    for r in order[:leftover]:
        counts[r] += 1
    return tuple(counts)


def contiguous_spans(counts: Sequence[int], unit: int, total: int) -> tuple[Span, ...]:
    """Consecutive spans of ``count * unit`` items; the last unit may stop short at ``total``."""
    spans, start = [], 0
    for count in counts:
        stop = min(start + count * unit, total)
        spans.append(Span(start=start, stop=stop))
        start = stop
    return tuple(spans)
