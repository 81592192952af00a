"""Who is in the cluster: mDNS discovery, the membership table, and a status poll of every
peer each second (liveness, and what each peer knows: its leader, epoch, worker)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from exo_tp.node.cluster.control import ControlClient, ControlRefused
from exo_tp.node.cluster.control_messages import NodeStatus
from exo_tp.node.cluster.discovery import Discovery
from exo_tp.node.cluster.membership import Membership
from exo_tp.wire.announcement import Announcement
from exo_tp.wire.ids import NodeId

log = logging.getLogger(__name__)

POLL_SECONDS = 1.0
FAST_POLL_SECONDS = 0.25
FAST_WINDOW_S = 5.0


class Peers:
    def __init__(
        self,
        me: Announcement,
        secret: str,
        interface: str,
        control: ControlClient,
        my_status: Callable[[], NodeStatus],
    ):
        self.me = me
        self.membership = Membership(me)
        # a node that just started settles as after a join: its peers' announcements are
        # on their way, and leading alone meanwhile starts a worker only to drop it
        self.membership.joined_at = time.monotonic()
        self._control, self._my_status = control, my_status
        self.statuses: dict[NodeId, NodeStatus] = {}
        self._seen: dict[NodeId, float] = {}  # when each status arrived
        self._discovery = Discovery(me, secret, interface, self._on_peer, self._on_gone)

    async def start(self) -> None:
        await self._discovery.start()

    async def stop(self) -> None:
        await self._discovery.stop()

    # ---- membership ------------------------------------------------------------------------

    def _on_peer(self, announcement: Announcement) -> None:
        if self.membership.upsert(announcement, time.monotonic()):
            log.info("peer %s joined (%s)", announcement.node_id, announcement.api_url)

    def _on_gone(self, node_id: NodeId) -> None:
        if self.membership.remove(node_id, time.monotonic()):
            log.info("peer %s left", node_id)

    def alive(self) -> list[Announcement]:
        return self.membership.alive()

    def alive_ids(self) -> tuple[NodeId, ...]:
        return self.membership.alive_ids()

    def leader_id(self) -> NodeId:
        return self.membership.leader_id()

    def get(self, node_id: NodeId) -> Announcement | None:
        return self.membership.get(node_id)

    @property
    def changed_at(self) -> float:
        return self.membership.changed_at

    @property
    def joined_at(self) -> float:
        return self.membership.joined_at

    def status(self, node_id: NodeId, max_age: float | None = None) -> NodeStatus | None:
        """A member's last status (this node's own is always fresh); None if older than
        ``max_age`` seconds."""
        if node_id == self.me.node_id:
            return self._my_status()
        seen = self._seen.get(node_id)
        if seen is None or (max_age is not None and time.monotonic() - seen > max_age):
            return None
        return self.statuses.get(node_id)

    # ---- the poll --------------------------------------------------------------------------

    def poll_interval(self, forming: bool) -> float:
        """Seconds until the next poll: `FAST_POLL_SECONDS` while the cluster is in motion (the
        alive set changed in the last `FAST_WINDOW_S`, or ``forming``: this node leads an
        epoch that is not serving yet), so that agreement on a new leader and workers turning
        ready are seen within a quarter second instead of a second; half a second alone."""
        if len(self.membership.members) <= 1:
            return POLL_SECONDS / 2
        if forming or time.monotonic() - self.membership.changed_at < FAST_WINDOW_S:
            return FAST_POLL_SECONDS
        return POLL_SECONDS

    async def poll_once(self) -> None:
        known = [
            m.announcement
            for m in self.membership.members.values()
            if m.announcement.node_id != self.me.node_id
        ]
        results = await asyncio.gather(
            *(self._control.status(p) for p in known), return_exceptions=True
        )
        now = time.monotonic()
        for peer, result in zip(known, results, strict=True):
            ok = isinstance(result, NodeStatus)
            if isinstance(result, NodeStatus):
                self.statuses[peer.node_id], self._seen[peer.node_id] = result, now
            elif not isinstance(
                result, aiohttp.ClientError | TimeoutError | ControlRefused | OSError | ValueError
            ):
                log.warning("status of %s: %s", peer.node_id, result)
            if self.membership.ping_result(peer.node_id, ok, now, _refused(result)) and not ok:
                log.warning("peer %s stopped answering", peer.node_id)


def _refused(result: object) -> bool:
    """Whether a poll failed because the peer's host refused the connection: its daemon is
    gone (a slow or unreachable peer times out instead)."""
    return isinstance(result, aiohttp.ClientConnectorError) and isinstance(
        result.os_error, ConnectionRefusedError
    )
