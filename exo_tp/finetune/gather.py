"""Just-in-time all-gathers of sharded base weights, chained in the order the model uses them.

A forward pass is a chain of steps: each call of a sharded module (an embedding lookup, a
linear, a tied LM head) is one step, and the order is recorded once by building (never
evaluating) a forward pass on a one-token input. Step k's weights are gathered when step k's
input exists, or, with prefetch, when step k-1's input exists, so the gather runs while step
k-1 computes. The backward pass walks the chain the other way: the vjp of step k re-gathers its
weights (tied to its cotangent) and, with prefetch, already issues step k-1's. Each gathered
weight is used by one step and then dropped, so only a step or two's whole weights are alive.

Order of collectives: every collective of a step (each gather and the loss's token count) also
depends on the one issued before it, so all ranks run them in the order they were issued, which
is the same everywhere. MLX's own schedule is not enough: ranks build slightly different graphs
(the rank with the largest shard sends it unpadded), and a different order pairs different
collectives across ranks (silent garbage). With prefetch, the gathers run on a stream of their
own, overlapping compute; mlx-lm's gradient all-reduce, on the default stream, needs every
gradient and so runs after all of them: two collectives are never in flight at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from exo_tp.shard.collectives import gather_rows_padded

Parts = dict[str, mx.array]


class Gathered(Protocol):
    """A module holding row shards of its weights (exo_tp.finetune.sharded)."""

    def shards(self) -> Parts: ...

    def cut(self) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
        """Each part's rows per rank and whole shape."""
        ...

    def assemble(self, gathered: Parts) -> Parts:
        """The module's weights from its gathered parts."""
        ...


@dataclass(frozen=True)
class Step:
    """One use of a sharded module in a forward pass."""

    module: Gathered
    differentiable: bool  # an embedding lookup needs no backward; a linear does


class GatherChain:
    """The recorded order of steps, the gathers issued ahead of them, and the order of every
    collective."""

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
        self._last: mx.array | None = None  # output of the latest collective issued

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
        self._last = None

    def all_gather(
        self,
        xs: Sequence[mx.array],
        sizes: Sequence[int] | Sequence[Sequence[int]],
        shapes: Sequence[Sequence[int]],
        tie: mx.array,
    ) -> list[mx.array]:
        """``gather_rows_padded`` of ``xs``, no earlier than ``tie`` exists and than the
        previous collective has finished."""
        after = [tie] if self._last is None else [tie, self._last]
        whole = gather_rows_padded(
            mx.depends(list(xs), after), sizes, self.group, shapes, self.stream
        )
        self._last = whole[0]
        return whole

    def gather(self, module: Gathered, tie: mx.array, shards: Parts | None = None) -> Parts:
        """Every part of ``module``'s weights, whole."""
        shards = shards if shards is not None else module.shards()
        sizes, shapes = module.cut()
        names = list(shards)
        whole = self.all_gather(
            [shards[n] for n in names], [sizes[n] for n in names], [shapes[n] for n in names], tie
        )
        return module.assemble(dict(zip(names, whole, strict=True)))

    def _aligned(self, k: int, module: Gathered) -> bool:
        return k < len(self.order) and self.order[k].module is module

    def forward(self, module: Gathered, tie: mx.array, differentiable: bool) -> tuple[int, Parts]:
        """Step k's gathered weights (issued earlier, or now tied to its input ``tie``)."""
        k = len(self._calls)
        self._calls.append(Step(module, differentiable))
        issued = self._ahead.pop(k, None)
        parts = issued[1] if issued and issued[0] is module else self.gather(module, tie)
        if self.prefetch and self._aligned(k, module) and k + 1 < len(self.order):
            nxt = self.order[k + 1].module
            self._ahead[k + 1] = (nxt, self.gather(nxt, tie))
        return k, parts

    def backward(self, k: int, module: Gathered, shards: Parts, tie: mx.array) -> Parts:
        """Step k's weights again for its vjp (prefetched by step k+1's vjp, or now)."""
        issued = self._behind.pop(k, None)
        parts = issued[1] if issued and issued[0] is module else self.gather(module, tie, shards)
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
            self._behind[before] = (prev, self.gather(prev, tie))
        return parts
