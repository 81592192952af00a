"""Just-in-time all-gathers of sharded base weights, chained in the order the model uses them.

A forward pass is a chain of steps: each call of a sharded module (an embedding lookup, a
linear, a tied LM head) is one step, and the order is recorded once by building (never
evaluating) a forward pass on a one-token input. Step k's weights are gathered when step k's
input exists, or, with prefetch, when step k-1's input exists, so the gather runs while step
k-1 computes. The backward pass walks the chain the other way: the vjp of step k re-gathers its
weights (tied to its cotangent) and, with prefetch, already issues step k-1's. Each gathered
weight is used by one step and then dropped, so at most two steps' full weights are alive.

Order of collectives: MLX runs the collectives of each stream in the order it schedules them,
which follows the graph, the same on every rank (every rank builds the same graph, only micro-
batch sizes differ). With prefetch, gathers run on their own stream so they overlap compute;
every other collective of a training step either runs on that stream too (the token count) or
depends on all evaluated gathers (mlx-lm's gradient all-reduce needs every gradient, which needs
the whole backward), so two collectives are never in flight at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

Parts = dict[str, mx.array]


class Gathered(Protocol):
    """A module holding row shards that can gather them whole (exo_tp.finetune.sharded)."""

    def gather(
        self,
        tie: mx.array,
        group: mx.distributed.Group,
        stream: mx.Stream | None,
        shards: Parts | None = None,
    ) -> Parts: ...


@dataclass(frozen=True)
class Step:
    """One use of a sharded module in a forward pass."""

    module: Gathered
    differentiable: bool  # an embedding lookup needs no backward; a linear does


class GatherChain:
    """The recorded order of steps and the gathers issued ahead of them."""

    def __init__(self, group: mx.distributed.Group, prefetch: bool):
        self.group = group
        self.prefetch = prefetch
        # Gathers overlap compute only on a stream of their own (one CPU thread per stream).
        self.stream: mx.Stream | None = mx.new_stream(mx.cpu) if prefetch else None
        self.order: tuple[Step, ...] = ()
        self._calls: list[Step] = []
        self._ahead: dict[int, tuple[Gathered, Parts]] = {}
        self._behind: dict[int, tuple[Gathered, Parts]] = {}
        self._backward_done: set[int] = set()

    def record(self, forward: Callable[[], object]) -> None:
        """Learn the order of steps from one forward pass that is built but never evaluated
        (so no collective runs)."""
        self.begin()
        forward()
        self.order = tuple(self._calls)
        self.begin()

    def begin(self) -> None:
        """A new forward pass starts (its first step is the embedding lookup)."""
        self._calls = []
        self._ahead.clear()
        self._behind.clear()
        self._backward_done.clear()

    def _aligned(self, k: int, module: Gathered) -> bool:
        return k < len(self.order) and self.order[k].module is module

    def forward(self, module: Gathered, tie: mx.array, differentiable: bool) -> tuple[int, Parts]:
        """Step k's gathered weights (issued earlier, or now tied to its input ``tie``)."""
        k = len(self._calls)
        self._calls.append(Step(module, differentiable))
        issued = self._ahead.pop(k, None)
        parts = (
            issued[1]
            if issued and issued[0] is module
            else module.gather(tie, self.group, self.stream)
        )
        if self.prefetch and self._aligned(k, module) and k + 1 < len(self.order):
            nxt = self.order[k + 1].module
            self._ahead[k + 1] = (nxt, nxt.gather(tie, self.group, self.stream))
        return k, parts

    def backward(self, k: int, module: Gathered, shards: Parts, tie: mx.array) -> Parts:
        """Step k's weights again for its vjp (prefetched by step k+1's vjp, or now)."""
        issued = self._behind.pop(k, None)
        parts = (
            issued[1]
            if issued and issued[0] is module
            else module.gather(tie, self.group, self.stream, shards)
        )
        self._backward_done.add(k)
        before = k - 1
        if (
            self.prefetch
            and self._aligned(k, module)
            and before >= 0
            and self.order[before].differentiable
            and before not in self._backward_done
            and before not in self._behind
        ):
            prev = self.order[before].module
            self._behind[before] = (prev, prev.gather(tie, self.group, self.stream))
        return parts
