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
MAIN_GROUP = ""  # the group every cluster has; others serve more models or replicas

WorkerState = Literal["none", "starting", "joining", "loading", "ready", "exited"]
EpochState = Literal["loading", "ready", "failed"]
Stall = Literal["frozen", "stuck"]


class MachineMemory(Frozen):
    """This machine's memory now, and the resident memory of the node's worker, bytes."""

    total: int | None = None
    available: int | None = None
    used: int | None = None
    worker_rss: int | None = None


class GroupWorker(Frozen):
    """A node's worker for one group other than the main one (several models resident, or a
    model's replicas): what the leader tracks that group's epoch with."""

    group: str
    epoch: Epoch | None = None
    state: WorkerState = "none"
    error: str | None = None
    stalled: Stall | None = None
    speed: RankSpeed | None = None
    links: tuple[LinkProfile, ...] = ()
    rank_memory: RankMemory | None = None
    model: str | None = None  # the model key it serves


class GroupView(Frozen):
    """One group of the cluster: a model over its nodes (the main group, another resident
    model, or a replica), its load and how long it stays (issue #59). The leader's status
    carries them, so that every node's /v1/cluster shows them."""

    group: str  # "" for the main group; the model key (and #replica) for the others
    model: str  # its name
    key: str
    replica: int = 0
    epoch: Epoch = Epoch(0)  # its epoch now (a re-plan of the group makes a new one)
    state: EpochState
    ranks: tuple[NodeId, ...] = ()  # node id per rank
    pinned: bool = False  # stays until a client unloads it (named with --model)
    in_flight: int = 0
    waiting: int = 0
    idle_seconds: float | None = None  # since its last request ended (None while busy)
    expires_in: float | None = None  # until it is let go if nothing runs (None: never)


class NodeStatus(Frozen):
    """What a node tells its peers every poll (and the leader tracks epochs with). The
    ``worker_*`` fields are its main group's worker; ``workers`` every other group's."""

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
    workers: tuple[GroupWorker, ...] = ()  # its workers of groups other than the main one
    # every group the leader leads (on the leader's status only): what every node's views show
    groups: tuple[GroupView, ...] = ()

    def for_group(self, group: str) -> NodeStatus:
        """This status as the leader of ``group`` reads it: that group's worker in the
        ``worker_*`` fields (none where the node runs none of it)."""
        if group == MAIN_GROUP:
            return self
        worker = next((w for w in self.workers if w.group == group), GroupWorker(group=group))
        return self.model_copy(
            update={
                "worker_epoch": worker.epoch,
                "worker_state": worker.state,
                "worker_error": worker.error,
                "worker_stalled": worker.stalled,
                "speed": worker.speed,
                "links": worker.links,
                "rank_memory": worker.rank_memory,
            }
        )


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
    group: str = MAIN_GROUP  # which of the node's workers runs it
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
    group: str = MAIN_GROUP


class Released(Frozen):
    released: Epoch
