"""The leader's live balance as every node shows it (`/v1/cluster`, `/v1/plan`, the web UI):
each rank's measured speed and share, the imbalance, and past re-plans. It rides in the
leader's status to the other nodes (`exo_tp.node.cluster.control.NodeStatus`)."""

from __future__ import annotations

from typing import Literal

from exo_tp.frozen import Frozen
from exo_tp.wire.ids import Epoch, NodeId


class RankBalanceView(Frozen):
    rank: int
    node_id: str
    share: float | None  # of the shard bytes
    speed_bytes_per_second: float | None  # smoothed (the policy's figure)
    latest_bytes_per_second: float | None
    samples: int
    work_factor: float | None  # the lab's emulated slowdown, when set
    sampled_at: float | None  # wall-clock time of the latest sample


class RebalanceView(Frozen):
    from_epoch: Epoch
    imbalance: float
    speeds: dict[NodeId, float]  # bytes/s per node when it re-planned
    at: float
    drained_seconds: float


class BalanceView(Frozen):
    """Live rank speeds, shares and imbalance (the leader's), and past re-plans."""

    enabled: bool
    threshold: float
    imbalance: float | None
    over_threshold_seconds: float | None  # how long the imbalance has been over the threshold
    state: Literal["serving", "draining"]
    skipped: str  # why the last due re-plan was not done ('' if none)
    ranks: tuple[RankBalanceView, ...]
    rebalances: tuple[RebalanceView, ...]
