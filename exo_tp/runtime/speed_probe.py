"""A rank's live compute speed: a timed solo pass of decode-shaped products, collectives left out.

Between two batch steps, every ``PROBE_SECONDS``, the rank runs one decode-shaped product
through each of a fixed set of probe matrices (the same on every rank, of one typical layer
size, distinct buffers far beyond the caches, as weights are read in a decode) and reports the
weight bytes read per second (`RankSpeed`, in its heartbeat). The probe matrices go through the
same kind of modules the model calls, wrapped by the lab's work factor when the model's are, so
whatever slows the rank's real matmuls (another program on its core, thermal throttling, the
lab's factor) slows the probe alike, while time spent waiting for peers in collectives does not
count. Two passes every few seconds, the faster counts: about 8 ms each on a CPU core.

When: after the first step that ends past the next multiple of ``PROBE_SECONDS`` on the wall
clock, not a rank's own timer. The ranks of a stage end each step together (its collectives
join them) and read the same clock (one machine, or NTP), so they probe after the same step,
at the same moment: whatever slows the whole machine then (a busy host, its memory bus) slows
every rank's probe alike and cancels in the ratio of their speeds, which is all a re-plan
reads. What slows one rank only does not cancel: on this project's 2-core VM, probed within
0.1 s of its peer, a rank at the same factor read 25-45% below it for a minute at a time (the
policy's cost term keeps that from re-planning, `exo_tp.plan.rebalance`).

Why not the rank's own linears: each call also costs a fixed time whatever its size, so timing
the shard's own matrices made a rank with a small share look slower per byte than it is. A
re-plan that shrank a slow rank's share then made it read slower still and the shares ran away
(the lab read a 2.5x slower device as 3.1x, then 4.9x). The same matrices on every rank measure
the device, not its share.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream

from exo_tp.lab.slowdown import SlowLinear
from exo_tp.plan.rebalance import RankSpeed
from exo_tp.shard.tree import flat_items

PROBE_SECONDS = 2.0
# One typical decode-shaped product (SmolLM2's FFN projection, float32: 3.5 MB) over 16
# distinct matrices: 57 MB, read from memory as a decode reads its layers.
PROBE_SHAPE = (1536, 576)
PROBE_MATRICES = 16


def _linear_leaves(model: nn.Module) -> list[nn.Module]:
    found: list[nn.Module] = []
    for _, module in flat_items(model.leaf_modules(), is_leaf=lambda m: isinstance(m, nn.Module)):
        if isinstance(module, nn.Linear | nn.QuantizedLinear):
            found.append(module)
    return found


def _bytes(module: nn.Module) -> int:
    return sum(p.nbytes for _, p in flat_items(module.parameters()))


def _probe_calls(model: nn.Module) -> list[tuple[nn.Module, mx.array]]:
    """The probe's products, lab-wrapped like the model's linears when they are."""
    wrapper = next((m for _, m in model.named_modules() if isinstance(m, SlowLinear)), None)
    calls: list[tuple[nn.Module, mx.array]] = []
    for index in range(PROBE_MATRICES):
        out, width = PROBE_SHAPE
        linear = nn.Linear(width, out, bias=False)
        linear.weight = mx.random.normal((out, width), key=mx.random.key(index)) / width**0.5
        probe: nn.Module = SlowLinear(linear, wrapper.source) if wrapper else linear
        calls.append((probe, mx.random.uniform(-1, 1, (1, 1, width))))
    mx.eval([c.parameters() for c, _ in calls], [x for _, x in calls])
    return calls


class SpeedProbe:
    def __init__(self, model: nn.Module, work_factor: Callable[[], float] = lambda: 1.0):
        self._calls = _probe_calls(model)
        self._probe_bytes = PROBE_MATRICES * PROBE_SHAPE[0] * PROBE_SHAPE[1] * 4
        self._shard_bytes = sum(_bytes(m) for m in _linear_leaves(model))
        self._work_factor = work_factor
        self._next = _next_tick(time.time())
        self._count = 0
        self.last: RankSpeed | None = None

    def measure(self) -> RankSpeed | None:
        if not self._calls or self._probe_bytes == 0:
            return None
        # mlx-lm evaluates the next step ahead on its own stream: wait for it, or the probe
        # shares the device with it and a rank reads slower the more its step computes (a
        # 2.5x lab rank read 4.4x at even shares, where it is the bottleneck, 1.7x at a small
        # share: a re-plan overshot to 0.82 : 0.18 for a 0.71 : 0.29 balance)
        mx.synchronize(generation_stream)
        seconds = float("inf")
        for _ in range(2):  # the faster of two: a passing preemption is not the device's speed
            start = time.perf_counter()
            mx.eval([module(x) for module, x in self._calls])
            seconds = min(seconds, time.perf_counter() - start)
        self._count += 1
        self.last = RankSpeed(
            shard_bytes=self._shard_bytes,
            probe_bytes=self._probe_bytes,
            seconds=max(seconds, 1e-9),
            at=time.time(),
            samples=self._count,
            work_factor=self._work_factor(),
        )
        return self.last

    def maybe(self) -> None:
        """Between batch steps: measure if one is due."""
        if time.time() >= self._next:
            self.measure()
            self._next = _next_tick(time.time())


def _next_tick(now: float) -> float:
    """The next multiple of PROBE_SECONDS on the wall clock (the same for every rank)."""
    return (math.floor(now / PROBE_SECONDS) + 1) * PROBE_SECONDS
