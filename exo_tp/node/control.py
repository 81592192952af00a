"""The signed control plane between nodes: typed bodies over HTTP, signed with the cluster
secret (HMAC of time, path and body; the secret itself never travels).

Routes: status (liveness and what a node knows), ports (fresh ports for a new epoch), assign
(start a worker for an epoch, with the weights it loads), release (stop the worker of an old
epoch). The weight routes (exo_tp.node.weights) are mounted beside them.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Literal

from aiohttp import web

from exo_tp.frozen import Frozen
from exo_tp.models.hub import DownloadProgress
from exo_tp.node.announcement import Announcement
from exo_tp.node.balance_messages import BalanceView
from exo_tp.node.finetune_messages import FineTunedModel, FinetuneRankStatus
from exo_tp.node.weight_messages import WeightOrder, WeightsStatus
from exo_tp.plan.devices import LinkProfile, ProfileSummary
from exo_tp.plan.rebalance import RankSpeed
from exo_tp.runtime.job import Assignment
from exo_tp.wire.errors import PeerRefused
from exo_tp.wire.http import SignedClient, get, post, signed_app
from exo_tp.wire.ids import Epoch, NodeId
from exo_tp.wire.runtime import RankMemory

log = logging.getLogger(__name__)

MAX_BODY = 64 << 20

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
    weights: WeightsStatus = WeightsStatus()  # models it offers, its fetch, bytes it served
    speed: RankSpeed | None = None  # its worker's latest live speed sample (rebalancing)
    downloads: tuple[DownloadProgress, ...] = ()  # hub models it is fetching (or fetched)
    finetune: FinetuneRankStatus | None = None  # its rank of a fine-tuning job
    fine_tuned: tuple[FineTunedModel, ...] = ()  # the models its fine-tuning jobs made
    balance: BalanceView | None = None  # the leader's live balance, for every node's views


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
    # the adapter of this fine-tuning job, from the node's own copy, on every shard
    adapter_job: str | None = None


class Accepted(Frozen):
    accepted: Epoch


class Release(Frozen):
    epoch: Epoch


class Released(Frozen):
    released: Epoch


# The old name of the one refusal (exo_tp.wire.errors), still raised by the node's handlers.
ControlRefused = PeerRefused


class ControlClient:
    """Signed requests to peers' control servers."""

    def __init__(self, secret: str):
        self._client = SignedClient(secret)

    async def status(self, peer: Announcement) -> NodeStatus:
        return await self._client.call(peer.control_url, "/control/status", None, NodeStatus)

    async def ports(self, peer: Announcement, epoch: int) -> Ports:
        return await self._client.call(
            peer.control_url, "/control/ports", PortsRequest(epoch=epoch), Ports
        )

    async def assign(
        self,
        peer: Announcement,
        assignment: Assignment,
        leader: str,
        weights: WeightOrder | None = None,
        adapter_job: str | None = None,
    ) -> Accepted:
        return await self._client.call(
            peer.control_url,
            "/control/assign",
            Assign(assignment=assignment, leader=leader, weights=weights, adapter_job=adapter_job),
            Accepted,
        )

    async def release(self, peer: Announcement, epoch: int) -> Released:
        return await self._client.call(
            peer.control_url, "/control/release", Release(epoch=epoch), Released
        )

    async def close(self) -> None:
        await self._client.close()


def control_app(
    secret: str,
    status: Callable[[], Awaitable[NodeStatus]],
    ports: Callable[[PortsRequest], Awaitable[Ports]],
    assign: Callable[[Assign], Awaitable[Accepted]],
    release: Callable[[Release], Awaitable[Released]],
) -> web.Application:
    """The control server; every request must carry a valid signature (401 otherwise)."""
    return signed_app(
        secret,
        [
            get("/control/status", status),
            post("/control/ports", PortsRequest, ports),
            post("/control/assign", Assign, assign),
            post("/control/release", Release, release),
        ],
        # Assignments carry a transfer plan, which can pass the default 1 MiB for big models.
        client_max_size=MAX_BODY,
    )
