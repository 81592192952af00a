"""The control plane's bodies: what a node tells its peers every poll (NodeStatus), and the
leader's requests to form an epoch (ports, assign, release) with their replies. The routes and
the client are exo_tp.node.cluster.control's."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from exo_tp.frozen import Frozen
from exo_tp.models.hub import DownloadProgress
from exo_tp.node.cluster.finetune_messages import FineTunedModel, FinetuneRankStatus
from exo_tp.node.cluster.weight_orders import WeightOrder, WeightsStatus
from exo_tp.plan.rebalance import RankSpeed
from exo_tp.wire.assignment import Assignment
from exo_tp.wire.balance import BalanceView
from exo_tp.wire.ids import Epoch, NodeId
from exo_tp.wire.profiles import LinkProfile, ProfileSummary
from exo_tp.wire.runtime import RankMemory

ECHO_MAX = 1 << 20  # the largest echo a probe may ask for

WorkerState = Literal["none", "starting", "joining", "loading", "ready", "exited"]
EpochState = Literal["loading", "ready", "failed"]
Stall = Literal["frozen", "stuck"]


class MachineMemory(Frozen):
    """This machine's memory now, and the resident memory of the node's worker, bytes."""

    total: int | None = None
    available: int | None = None
    used: int | None = None
    worker_rss: int | None = None


class NodeStatus(Frozen):
    """What a node tells its peers every poll (and the leader tracks epochs with)."""

    node_id: NodeId
    leader: NodeId | None
    epoch: Epoch  # the highest epoch this node has seen
    worker_epoch: Epoch | None = None
    worker_state: WorkerState = "none"
    worker_error: str | None = None
    worker_stalled: Stall | None = None
    profile: ProfileSummary | None = None
    weight: float = 0.0
    cluster_state: EpochState | None = None  # the leader's epoch, as the leader sees it
    cluster_reason: str | None = None
    backends: tuple[str, ...] = ("ring",)
    rdma: dict[str, str] = {}
    memory: MachineMemory = MachineMemory()
    rank_memory: RankMemory | None = None
    links: tuple[LinkProfile, ...] = ()  # its worker's stage links, timed as the group formed
    # its links to the peers it knew at its last probe round (exo_tp.node.member.link_probes)
    probes: tuple[LinkProfile, ...] = ()
    weights: WeightsStatus = WeightsStatus()  # models it offers, its fetch, bytes it served
    speed: RankSpeed | None = None  # its worker's latest live speed sample (rebalancing)
    downloads: tuple[DownloadProgress, ...] = ()  # hub models it is fetching (or fetched)
    finetune: FinetuneRankStatus | None = None  # its rank of a fine-tuning job
    fine_tuned: tuple[FineTunedModel, ...] = ()  # the models its fine-tuning jobs made
    balance: BalanceView | None = None  # the leader's live balance, for every node's views


class Echo(Frozen):
    """A link probe's request: ``size`` zero bytes back (exo_tp.node.member.link_probes)."""

    size: int = Field(default=0, ge=0, le=ECHO_MAX)


class PortsRequest(Frozen):
    epoch: Epoch  # the epoch the leader is forming


class Ports(Frozen):
    ring: int
    conductor: int
    hop: int


class Assign(Frozen):
    assignment: Assignment
    leader: NodeId
    weights: WeightOrder | None = None  # None: load assignment.model from this node's files
    # The conductor's node: the draft model (speculative decoding), whole; None: it resolves
    # serving.draft_model itself (or there is none).
    draft: WeightOrder | None = None
    # the adapter of this fine-tuning job, from the node's own copy, on every shard
    adapter_job: str | None = None


class Accepted(Frozen):
    accepted: Epoch


class Release(Frozen):
    epoch: Epoch


class Released(Frozen):
    released: Epoch
