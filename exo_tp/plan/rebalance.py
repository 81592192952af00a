"""When to re-plan shares while serving: a pure decision over the ranks' live speed samples.

Each rank times a solo pass over its shard's matmuls (collectives left out) every few seconds
and reports the weight bytes it read and the seconds it took (`RankSpeed`). With shares b_i
(weight bytes per token on rank i) and speeds v_i (bytes/s), a tensor-parallel step takes as
long as its slowest rank, max_i b_i / v_i; a split following the speeds would take
sum b / sum v. The imbalance is the first over the second, minus one: what the slowest rank
costs over a balanced split.

Hysteresis, so noise never flaps the cluster: each rank's speed is the median of its last
``window`` samples; a re-plan is due only when that smoothed imbalance stayed above the threshold
for ``sustain_seconds`` without a break, and not within ``cooldown_seconds`` of the last one.
Speeds jittering by +-5% give at most ~5% imbalance over a balanced split, under the 10%
default.

A re-plan costs a drain and a reload (``replan_cost_seconds``) and gains the imbalance back for
as long as the new speeds last. How long a change in speed will last is unknown; how long it has
lasted already is the best guess, so a re-plan is due only once the imbalance has lasted long
enough for its gain to repay the cost: imbalance x seconds >= cost. A device 2.5x slower (0.75
over an even split) waits 20 s; a rank 20% slow (0.125), as another program on its core or a
busy neighbour on a shared host makes it for a while, waits 120 s and is usually back by then.
On this project's 2-core VM a rank at factor 1 read 25-45% below its peer for 20-60 s at a
time, and each re-plan that followed was undone by the next.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from pydantic import Field

from exo_tp.frozen import Frozen
from exo_tp.plan.cost import rank_load
from exo_tp.plan.pipeline import PipelinePlan

# A node's name: plain str here, exo_tp.wire.ids.NodeId where the node reads these (the
# planner does not import the wire package)
Node = TypeVar("Node", bound=str)


class RankSpeed(Frozen):
    """One live speed sample of a rank (sent in its heartbeat)."""

    shard_bytes: int = Field(ge=0)  # weight bytes of all this rank's matmuls (one token)
    probe_bytes: int = Field(gt=0)  # weight bytes the timed pass read
    seconds: float = Field(gt=0)
    at: float  # wall-clock time of the sample
    samples: int = Field(default=1, ge=1)  # probes taken so far in this epoch
    work_factor: float = 1.0  # the lab's emulated slowness (1: a real device)

    @property
    def bytes_per_second(self) -> float:
        return self.probe_bytes / self.seconds


def imbalance(shard_bytes: Sequence[float], speeds: Sequence[float]) -> float:
    """How much longer the slowest rank takes than a split following ``speeds`` would."""
    if not speeds or min(speeds) <= 0 or sum(shard_bytes) <= 0:
        return 0.0
    slowest = max(b / v for b, v in zip(shard_bytes, speeds, strict=True))
    return slowest * sum(speeds) / sum(shard_bytes) - 1.0


@dataclass(frozen=True)
class RebalancePolicy:
    threshold: float = 0.10
    window: int = 5  # samples per rank in its median
    min_samples: int = 3  # per rank, before any decision
    sustain_seconds: float = 8.0
    cooldown_seconds: float = 20.0
    # a re-plan's drain and reload (10-20 s measured here): the imbalance must last until its
    # gain repays that, imbalance x seconds >= cost
    replan_cost_seconds: float = 15.0

    def sustain_for(self, value: float) -> float:
        """Seconds an imbalance of ``value`` must last before a re-plan is due."""
        return max(self.sustain_seconds, self.replan_cost_seconds / max(value, 1e-9))


@dataclass(frozen=True)
class RebalanceState:
    """What the decision remembers between calls (one value: no hidden state)."""

    over_since: float | None = None  # when the smoothed imbalance went over the threshold
    last_replan: float = float("-inf")
    samples: Mapping[int, tuple[float, ...]] = field(default_factory=dict)  # rank -> speeds


@dataclass(frozen=True)
class Verdict:
    state: RebalanceState
    imbalance: float | None  # None until every rank has enough samples
    speeds: tuple[float, ...] | None  # smoothed speed per rank (same condition)
    replan: bool


def add_sample(
    state: RebalanceState, policy: RebalancePolicy, rank: int, speed: float
) -> RebalanceState:
    kept = (*state.samples.get(rank, ()), speed)[-policy.window :]
    return replace(state, samples={**state.samples, rank: kept})


def decide(
    state: RebalanceState,
    policy: RebalancePolicy,
    shard_bytes: Sequence[float],
    now: float,
) -> Verdict:
    """Whether to re-plan now, given every rank's samples so far (rank i holds
    ``shard_bytes[i]``)."""
    ranks = range(len(shard_bytes))
    if len(shard_bytes) < 2 or any(
        len(state.samples.get(r, ())) < policy.min_samples for r in ranks
    ):
        return Verdict(replace(state, over_since=None), None, None, False)
    speeds = tuple(statistics.median(state.samples[r]) for r in ranks)
    value = imbalance(shard_bytes, speeds)
    if value <= policy.threshold:
        return Verdict(replace(state, over_since=None), value, speeds, False)
    since = state.over_since if state.over_since is not None else now
    due = (
        now - since >= policy.sustain_for(value)
        and now - state.last_replan >= policy.cooldown_seconds
    )
    if due:
        return Verdict(RebalanceState(last_replan=now), value, speeds, True)
    return Verdict(replace(state, over_since=since), value, speeds, False)


def balanced_weights(speeds: Sequence[float], scale_to: Sequence[float]) -> list[float]:
    """Share weights following ``speeds``, on the scale of ``scale_to`` (the profile speeds the
    planner's cost model works in): same total, ratios of the live measurement."""
    total = sum(speeds)
    return [v * sum(scale_to) / total for v in speeds]


def token_seconds(
    plan: PipelinePlan, nodes: Sequence[Node], speeds: Mapping[Node, float]
) -> float | None:
    """Seconds of weight reading per token under ``plan`` at the ranks' live ``speeds``
    (bytes/s by node; ``nodes``: the node of each global rank): the slowest rank of each
    stage, summed over the stages. None if a rank's speed is unknown."""
    total = 0.0
    for index, stage in enumerate(plan.stages):
        first, last = index == 0, index == len(plan.stages) - 1
        slowest = 0.0
        for local, rank in enumerate(stage.ranks):
            speed = speeds.get(nodes[rank])
            if not speed:
                return None
            load = rank_load(stage.tp.spec, stage.tp.ranks[local], stage.layers, first, last)
            slowest = max(slowest, load.read_bytes / speed)
        total += slowest
    return total


def replan_gain(
    current: PipelinePlan,
    current_nodes: Sequence[Node],
    candidate: PipelinePlan,
    candidate_nodes: Sequence[Node],
    speeds: Mapping[Node, float],
) -> float | None:
    """How much faster the candidate split reads a token than the current one at the live
    speeds (0.2: 20% faster). Heads and quantization groups split in steps, so the best
    achievable split may be no better than the current one even when the continuous
    imbalance says otherwise. None when a speed is unknown."""
    now = token_seconds(current, current_nodes, speeds)
    new = token_seconds(candidate, candidate_nodes, speeds)
    if now is None or new is None or new <= 0:
        return None
    return now / new - 1.0
