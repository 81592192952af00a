"""A rank's live compute speed: a timed solo pass over its shard's matmuls, collectives left out.

Between two batch steps, every ``PROBE_SECONDS``, the rank runs one decode-shaped product
through a fixed third of its linear layers (the same layers on every rank of a stage: every
third in module order) and reports the weight bytes read per second (`RankSpeed`, in its
heartbeat). It goes through the very modules the model calls, so whatever slows the rank's
real matmuls (another program on its core, thermal throttling, the lab's work factor) slows the
probe alike, while time spent waiting for peers in collectives does not count. A pass costs
about two thirds of one token's compute (two passes, the faster counts), every few seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from exo_tp.lab.slowdown import SlowLinear
from exo_tp.plan.rebalance import RankSpeed

PROBE_SECONDS = 2.0
EVERY = 3  # probe every third linear layer


def _linear_leaves(model: nn.Module) -> list[nn.Module]:
    """The model's linear layers, a lab-slowed one as its wrapper (so the probe sees it)."""
    found: list[nn.Module] = []
    for _, module in tree_flatten(model.leaf_modules(), is_leaf=lambda m: isinstance(m, nn.Module)):
        if isinstance(module, nn.Linear | nn.QuantizedLinear):
            found.append(module)
    return found


def _wrapped(model: nn.Module) -> dict[int, nn.Module]:
    """id(inner linear) -> the lab wrapper holding it."""
    return {
        id(module["inner"]): module
        for _, module in model.named_modules()
        if isinstance(module, SlowLinear)
    }


def _bytes(module: nn.Module) -> int:
    return sum(p.nbytes for _, p in tree_flatten(module.parameters()))


def _input(module: nn.Module) -> mx.array:
    weight = module["weight"]
    if isinstance(module, nn.QuantizedLinear):
        width = weight.shape[1] * 32 // module.bits
        dtype = module["scales"].dtype
    else:
        width, dtype = weight.shape[1], weight.dtype
    return mx.random.uniform(-1, 1, (1, 1, width)).astype(dtype)


class SpeedProbe:
    def __init__(self, model: nn.Module, work_factor: Callable[[], float] = lambda: 1.0):
        linears = _linear_leaves(model)
        wrappers = _wrapped(model)
        chosen = linears[::EVERY]
        self._calls = [(wrappers.get(id(m), m), _input(m)) for m in chosen]
        self._probe_bytes = sum(_bytes(m) for m in chosen)
        self._shard_bytes = sum(_bytes(m) for m in linears)
        mx.eval([x for _, x in self._calls])
        self._work_factor = work_factor
        self._next = time.monotonic() + PROBE_SECONDS
        self._count = 0
        self.last: RankSpeed | None = None

    def measure(self) -> RankSpeed | None:
        if not self._calls or self._probe_bytes == 0:
            return None
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
        now = time.monotonic()
        if now >= self._next:
            self.measure()
            self._next = time.monotonic() + PROBE_SECONDS
