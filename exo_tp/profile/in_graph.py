"""What a collective costs inside a decode-like compute graph, not alone.

A lone 4 KB all_sum is one round trip (~35 µs on loopback here). Inside a forward pass each
all_sum also waits for the stream to hand it over, for the ring threads to wake and for the
peer's jitter: ~0.3 ms per all_sum on this 2-core box, which is what tensor parallelism pays
twice per layer. Both ranks run the same chain of decode-shaped steps (a matvec over weights
streamed from memory) with and without an all_sum after each step; the extra time per step,
over the slower rank's own chain, is the in-graph cost the planner prices a collective at.
"""

from __future__ import annotations

from typing import cast

import mlx.core as mx

from exo_tp.profile.collective_speed import median_seconds

WIDTH = 1024  # 4 MB float32 matrices ...
MATRICES = 24  # ... 96 MB of them, so weights come from memory as in a decode


def _chain(
    weights: list[mx.array], x: mx.array, group: mx.distributed.Group, steps: int, reduce: bool
) -> None:
    y = x
    for step in range(steps):
        y = y @ weights[step % len(weights)]
        if reduce:
            y = mx.distributed.all_sum(y, group=group) * 0.5
    mx.eval(y)


def all_sum_in_graph(group: mx.distributed.Group, quick: bool = False) -> float:
    """Seconds one small all_sum adds to a decode step (median over repeats, >= 0)."""
    steps, repeats = (20, 3) if quick else (30, 7)
    weights = [
        mx.random.normal((WIDTH, WIDTH), key=mx.random.key(i)) / WIDTH**0.5 for i in range(MATRICES)
    ]
    x = mx.ones((1, WIDTH))
    mx.eval(weights, x)
    alone = median_seconds(lambda: _chain(weights, x, group, steps, False), repeats)
    together = median_seconds(lambda: _chain(weights, x, group, steps, True), repeats)
    gathered = mx.distributed.all_gather(mx.array([alone]), group=group)
    slowest_alone = cast(float, gathered.max().item())  # (a float32 array)
    return max(0.0, (together - slowest_alone) / steps)
