"""Wall-clock timing of a repeated step, over long enough to average out a CPU quota.

The mean over the whole measured stretch is reported, not the best sample: a CFS quota lets a
process run at full speed and then freezes it until the next period, so short best-of samples
would hide the throttling (and sustained throughput is what decoding a model needs).
"""

from __future__ import annotations

import time
from collections.abc import Callable


def mean_seconds(
    step: Callable[[], object], min_seconds: float, min_steps: int = 2, warm_up: bool = True
) -> float:
    """Mean wall seconds of ``step`` over >= ``min_seconds`` and >= ``min_steps`` calls, after
    one untimed warm-up call (allocations, lazy initialisation) unless ``warm_up`` is False."""
    if warm_up:
        step()
    steps, start = 0, time.perf_counter()
    while True:
        step()
        steps += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds and steps >= min_steps:
            return elapsed / steps
