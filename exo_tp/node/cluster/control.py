"""The signed control plane between nodes: typed bodies over HTTP, signed with the cluster
secret (HMAC of time, path and body; the secret itself never travels).

Routes: status (liveness and what a node knows), ports (fresh ports for a new epoch), assign
(start a worker for an epoch, with the weights it loads), release (stop the worker of an old
epoch), echo (bytes back, for a link probe). The bodies are in exo_tp.node.cluster.control_messages;
the weight routes (exo_tp.node.member.weights) are mounted beside them.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from exo_tp.node.cluster.control_messages import (
    MAIN_GROUP,
    Accepted,
    Assign,
    Echo,
    NodeStatus,
    Ports,
    PortsRequest,
    Release,
    Released,
)
from exo_tp.node.cluster.weight_orders import WeightOrder
from exo_tp.wire.announcement import Announcement
from exo_tp.wire.assignment import Assignment
from exo_tp.wire.errors import PeerRefused
from exo_tp.wire.http import SignedClient, get, post, signed_app
from exo_tp.wire.ids import Epoch, NodeId

log = logging.getLogger(__name__)

MAX_BODY = 64 << 20

# The old name of the one refusal (exo_tp.wire.errors), still raised by the node's handlers.
ControlRefused = PeerRefused


class ControlClient:
    """Signed requests to peers' control servers."""

    def __init__(self, secret: str):
        self._client = SignedClient(secret)

    async def status(self, peer: Announcement) -> NodeStatus:
        return await self._client.call(peer.control_url, "/control/status", None, NodeStatus)

    async def ports(self, peer: Announcement, epoch: Epoch) -> Ports:
        return await self._client.call(
            peer.control_url, "/control/ports", PortsRequest(epoch=epoch), Ports
        )

    async def assign(
        self,
        peer: Announcement,
        assignment: Assignment,
        leader: NodeId,
        weights: WeightOrder | None = None,
        adapter_job: str | None = None,
        draft: WeightOrder | None = None,
        group: str = MAIN_GROUP,
    ) -> Accepted:
        return await self._client.call(
            peer.control_url,
            "/control/assign",
            Assign(
                assignment=assignment,
                leader=leader,
                weights=weights,
                adapter_job=adapter_job,
                group=group,
                draft=draft,
            ),
            Accepted,
        )

    async def echo(self, peer: Announcement, size: int) -> bytes:
        """``size`` bytes from the peer (a link probe's round trip)."""
        return await self._client.read(peer.control_url, "/control/echo", Echo(size=size))

    async def release(self, peer: Announcement, epoch: Epoch, group: str = MAIN_GROUP) -> Released:
        return await self._client.call(
            peer.control_url, "/control/release", Release(epoch=epoch, group=group), Released
        )

    async def close(self) -> None:
        await self._client.close()


async def _echo(request: Echo) -> bytes:
    return bytes(request.size)


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
            post("/control/echo", Echo, _echo),
        ],
        # Assignments carry a transfer plan, which can pass the default 1 MiB for big models.
        client_max_size=MAX_BODY,
    )
