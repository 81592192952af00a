"""The leader's side of rebalancing while serving: collect the ranks' live speed samples from
their nodes' statuses, decide with the pure hysteresis (exo_tp.plan.rebalance), and show it.

A re-plan it triggers is planned, hence graceful: the dispatcher holds new requests (they wait,
no 503), requests in flight finish (or ``DRAIN_SECONDS`` pass), then the leader forms a new epoch
whose shares follow the measured speeds. Only tensor-parallel epochs of one stage rebalance (a
pipeline's stages run one after the other: there is no split to balance across them).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from exo_tp.node.cluster.control_messages import NodeStatus
from exo_tp.node.leader.state import LedEpoch
from exo_tp.plan.rebalance import (
    RankSpeed,
    RebalancePolicy,
    RebalanceState,
    Verdict,
    add_sample,
    balanced_weights,
    decide,
)
from exo_tp.wire.balance import BalanceView, RankBalanceView, RebalanceView
from exo_tp.wire.ids import Epoch, NodeId

log = logging.getLogger(__name__)

# Longest a planned re-plan waits for requests in flight to finish: long, since cutting them
# would lose them (a loaded cluster takes minutes over a batch of long answers); a stuck one is
# the stall watchdog's, which fails the epoch anyway.
DRAIN_SECONDS = 600.0
SAMPLE_MAX_AGE = 15.0  # a sample older than this (an idle cluster probes nothing) is not news


@dataclass
class Rebalanced:
    """One re-plan the live speeds triggered (shown in the views)."""

    from_epoch: Epoch
    imbalance: float
    speeds: dict[NodeId, float]
    at: float = field(default_factory=time.time)
    drained_seconds: float = 0.0


class LiveBalance:
    def __init__(self, policy: RebalancePolicy, enabled: bool):
        self.policy, self.enabled = policy, enabled
        self.state = RebalanceState()
        self.epoch: Epoch | None = None
        self.latest: dict[NodeId, RankSpeed] = {}  # node id -> its rank's latest sample
        self.verdict: Verdict | None = None
        self.draining_since: float | None = None
        self.history: list[Rebalanced] = []
        # the live share weights the next plan uses, and the members they were measured for
        self.weights: dict[NodeId, float] = {}
        self.weights_members: tuple[NodeId, ...] = ()
        self._nodes: tuple[NodeId, ...] = ()
        self.skipped = ""  # why the last due re-plan was not done

    def observe(
        self, led: LedEpoch, statuses: Mapping[NodeId, NodeStatus | None], now: float
    ) -> bool:
        """Take the new samples of ``led``'s ranks; True when a re-plan is due."""
        if led.number != self.epoch:  # new shares: earlier samples describe another split
            self.epoch, self.latest, self.verdict = led.number, {}, None
            self._nodes = tuple(led.nodes)
            self.state = RebalanceState(last_replan=self.state.last_replan)
        for rank, node in enumerate(led.nodes):
            status = statuses.get(node)
            sample = status.speed if status and status.worker_epoch == led.number else None
            if sample is None or time.time() - sample.at > SAMPLE_MAX_AGE:
                continue
            seen = self.latest.get(node)
            if seen is None or seen.at != sample.at:
                self.latest[node] = sample
                self.state = add_sample(self.state, self.policy, rank, sample.bytes_per_second)
        if led.plan is None or len(led.plan.stages) != 1 or len(self.latest) < len(led.nodes):
            return False
        shard_bytes = [self.latest[n].shard_bytes for n in led.nodes]
        self.verdict = decide(self.state, self.policy, shard_bytes, now)
        self.state = self.verdict.state
        return self.enabled and self.verdict.replan

    def begin(
        self, led: LedEpoch, members: Sequence[NodeId], profile_weights: Mapping[NodeId, float]
    ) -> None:
        """Start a planned re-plan: remember the weights the next plan uses."""
        assert self.verdict is not None and self.verdict.speeds is not None
        speeds = dict(zip(led.nodes, self.verdict.speeds, strict=True))
        scale = [profile_weights.get(n, 1.0) for n in speeds]
        self.weights = dict(
            zip(speeds, balanced_weights(list(speeds.values()), scale), strict=True)
        )
        self.weights_members = tuple(sorted(members))
        self.draining_since = time.monotonic()
        self.history.append(
            Rebalanced(
                from_epoch=led.number, imbalance=self.verdict.imbalance or 0.0, speeds=speeds
            )
        )
        log.info(
            "epoch %d: the slowest rank costs %.0f%% over a balanced split (live speeds %s); "
            "re-planning once requests in flight finish",
            led.number,
            100 * (self.verdict.imbalance or 0.0),
            ", ".join(f"{n} {v / 1e6:.0f} MB/s" for n, v in speeds.items()),
        )

    def speeds(self) -> dict[NodeId, float]:
        """The smoothed live speed of each rank's node (bytes/s) behind the last verdict."""
        if self.verdict is None or self.verdict.speeds is None or self.epoch is None:
            return {}
        return dict(zip(self._nodes, self.verdict.speeds, strict=True))

    def cancel(self, reason: str) -> None:
        """The re-plan would not pay (steps of heads and groups): keep serving, and wait the
        cooldown before deciding again."""
        self.draining_since = None
        self.weights, self.weights_members = {}, ()
        if self.history:
            self.history.pop()
        self.skipped = reason
        log.info("not re-planning: %s", reason)

    def drained(self, in_flight: int) -> bool:
        assert self.draining_since is not None
        waited = time.monotonic() - self.draining_since
        if in_flight and waited < DRAIN_SECONDS:
            return False
        self.history[-1].drained_seconds = round(waited, 2)
        self.draining_since = None
        return True

    def live_weights(self, members: Sequence[NodeId]) -> dict[NodeId, float]:
        """The measured weights, while the members are those they were measured for."""
        return self.weights if tuple(sorted(members)) == self.weights_members else {}

    def view(self, led: LedEpoch | None) -> BalanceView:
        """Each rank's live speed and share, and the imbalance: /v1/cluster, /v1/plan, web UI."""
        ranks = []
        if led is not None and led.number == self.epoch:
            total = sum(s.shard_bytes for s in self.latest.values()) or 1
            smoothed = self.verdict.speeds if self.verdict and self.verdict.speeds else None
            for rank, node in enumerate(led.nodes):
                sample = self.latest.get(node)
                ranks.append(
                    RankBalanceView(
                        rank=rank,
                        node_id=node,
                        share=sample.shard_bytes / total if sample else None,
                        speed_bytes_per_second=smoothed[rank]
                        if smoothed
                        else (sample.bytes_per_second if sample else None),
                        latest_bytes_per_second=sample.bytes_per_second if sample else None,
                        samples=sample.samples if sample else 0,
                        work_factor=sample.work_factor if sample else None,
                        sampled_at=sample.at if sample else None,
                    )
                )
        verdict = self.verdict
        return BalanceView(
            enabled=self.enabled,
            threshold=self.policy.threshold,
            imbalance=verdict.imbalance if verdict else None,
            over_threshold_seconds=None
            if self.state.over_since is None
            else round(time.monotonic() - self.state.over_since, 1),
            state="draining" if self.draining_since is not None else "serving",
            skipped=self.skipped,
            ranks=tuple(ranks),
            rebalances=tuple(
                RebalanceView(
                    from_epoch=r.from_epoch,
                    imbalance=r.imbalance,
                    speeds=dict(r.speeds),
                    at=r.at,
                    drained_seconds=r.drained_seconds,
                )
                for r in self.history[-10:]
            ),
        )
