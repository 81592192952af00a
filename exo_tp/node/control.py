"""The signed control plane between nodes: typed bodies over HTTP, signed with the cluster
secret (HMAC of time, path and body; the secret itself never travels).

Routes: status (liveness and what a node knows), ports (fresh ports for a new epoch), assign
(start a worker for an epoch, with the weights it loads), release (stop the worker of an old
epoch). The weight routes (exo_tp.node.weights) are mounted beside them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Literal, TypeVar

import aiohttp
from aiohttp import web
from pydantic import BaseModel, ValidationError

from exo_tp.frozen import Frozen
from exo_tp.node.announcement import Announcement
from exo_tp.node.weight_messages import WeightOrder, WeightsStatus
from exo_tp.plan.devices import LinkProfile, ProfileSummary
from exo_tp.plan.rebalance import RankSpeed
from exo_tp.runtime.job import Assignment
from exo_tp.runtime.messages import RankMemory
from exo_tp.security.signing import control_headers, control_request_ok

log = logging.getLogger(__name__)

TIMEOUT = aiohttp.ClientTimeout(total=3)
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

    node_id: str
    leader: str | None
    epoch: int  # the highest epoch this node has seen
    worker_epoch: int | None = None
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


class PortsRequest(Frozen):
    epoch: int  # the epoch the leader is forming


class Ports(Frozen):
    ring: int
    conductor: int
    hop: int


class Assign(Frozen):
    assignment: Assignment
    leader: str
    weights: WeightOrder | None = None  # None: load assignment.model from this node's files


class Accepted(Frozen):
    accepted: int


class Release(Frozen):
    epoch: int


class Released(Frozen):
    released: int


class Refused(Frozen):
    error: str


class ControlRefused(Exception):
    """A peer answered a control request with an error (e.g. a stale epoch)."""


R = TypeVar("R", bound=BaseModel)
B = TypeVar("B", bound=BaseModel)


class ControlClient:
    """Signed requests to peers' control servers."""

    def __init__(self, secret: str):
        self._secret = secret
        self._session: aiohttp.ClientSession | None = None

    async def _call(
        self, peer: Announcement, path: str, body: BaseModel | None, reply: type[R]
    ) -> R:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=TIMEOUT)
        data = body.model_dump_json().encode() if body is not None else b""
        headers = {"Content-Type": "application/json", **control_headers(self._secret, path, data)}
        method = "GET" if body is None else "POST"
        async with self._session.request(
            method, peer.control_url + path, data=data, headers=headers
        ) as response:
            raw = await response.read()
            if response.status != 200:
                try:
                    raise ControlRefused(Refused.model_validate_json(raw).error)
                except ValidationError:
                    raise ControlRefused(f"HTTP {response.status}") from None
            return reply.model_validate_json(raw)

    async def status(self, peer: Announcement) -> NodeStatus:
        return await self._call(peer, "/control/status", None, NodeStatus)

    async def ports(self, peer: Announcement, epoch: int) -> Ports:
        return await self._call(peer, "/control/ports", PortsRequest(epoch=epoch), Ports)

    async def assign(
        self,
        peer: Announcement,
        assignment: Assignment,
        leader: str,
        weights: WeightOrder | None = None,
    ) -> Accepted:
        return await self._call(
            peer,
            "/control/assign",
            Assign(assignment=assignment, leader=leader, weights=weights),
            Accepted,
        )

    async def release(self, peer: Announcement, epoch: int) -> Released:
        return await self._call(peer, "/control/release", Release(epoch=epoch), Released)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def _handler(
    body: type[B] | None,
    handle: Callable[..., Awaitable[BaseModel]],
) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def route(request: web.Request) -> web.Response:
        try:
            args = [body.model_validate_json(await request.read())] if body else []
        except ValidationError as error:
            return _reply(Refused(error=f"bad body: {error.errors()[0]['msg']}"), 400)
        try:
            return _reply(await handle(*args))
        except ControlRefused as refused:
            return _reply(Refused(error=str(refused)), 409)

    return route


def _reply(body: BaseModel, status: int = 200) -> web.Response:
    return web.Response(body=body.model_dump_json(), status=status, content_type="application/json")


def control_app(
    secret: str,
    status: Callable[[], Awaitable[NodeStatus]],
    ports: Callable[[PortsRequest], Awaitable[Ports]],
    assign: Callable[[Assign], Awaitable[Accepted]],
    release: Callable[[Release], Awaitable[Released]],
) -> web.Application:
    """The control server; every request must carry a valid signature (401 otherwise)."""

    @web.middleware
    async def signed(
        request: web.Request,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        body = await request.read()
        if not control_request_ok(secret, request.path, body, dict(request.headers)):
            return web.Response(
                body=json.dumps({"error": "bad or missing signature"}),
                status=401,
                content_type="application/json",
            )
        return await handler(request)

    # Assignments carry a transfer plan, which can pass the default 1 MiB for big models.
    app = web.Application(middlewares=[signed], client_max_size=MAX_BODY)
    app.add_routes(
        [
            web.get("/control/status", _handler(None, status)),
            web.post("/control/ports", _handler(PortsRequest, ports)),
            web.post("/control/assign", _handler(Assign, assign)),
            web.post("/control/release", _handler(Release, release)),
        ]
    )
    return app
