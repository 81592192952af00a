"""This node's links to its peers, measured when the membership it sees changes (before the
leader's first plan over it), and told to the cluster in its status (NodeStatus.probes).

A probe is signed round trips to the peer's control server over the same TCP path the ring
will use: the quickest of a few empty echoes, and the quickest of two bulk echoes. The same
echoes to this node's own server give the overhead that HTTP adds on this machine; what a peer
takes beyond it is the link. The planner's link figures are a 2-rank all_sum's, so a probe
estimates them: latency = MLX's own all_sum cost on loopback + the round trip beyond this
machine's own, bandwidth = the bulk echo's payload rate. `exo-tp bench --peers` measures the
all_sum itself; where profiles hold such links the planner prefers them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from exo_tp.node.cluster.control import ControlClient
from exo_tp.wire.announcement import Announcement
from exo_tp.wire.errors import PeerRefused
from exo_tp.wire.ids import NodeId
from exo_tp.wire.profiles import LinkProfile, measured_now

log = logging.getLogger(__name__)

PINGS = 8  # empty echoes per peer: the quickest is the round trip
BULK_BYTES = 256 << 10  # a bulk echo: long enough to time the rate, short on a slow link
BULKS = 2
# A 2-rank MLX ring all_sum of 4 KB on loopback (shared notes: ~80 us): what a link with no
# delay of its own still costs a collective.
ALL_SUM_FLOOR = 80e-6
CHECK_SECONDS = 0.5


class LinkProbes:
    """This node's latest probe round: a link per peer it knew then."""

    def __init__(self, me: Announcement, control: ControlClient):
        self._me, self._control = me, control
        self._links: dict[NodeId, LinkProfile] = {}
        self._round_for: tuple[str, ...] | None = None  # the alive ids the round covered

    def links(self) -> tuple[LinkProfile, ...]:
        return tuple(self._links[n] for n in sorted(self._links))

    async def probe_forever(self, alive: Callable[[], list[Announcement]]) -> None:
        """Probe every peer again whenever the alive members ``alive()`` change."""
        while True:
            members = alive()
            ids = tuple(sorted(a.node_id for a in members))
            if ids != self._round_for:
                others = [a for a in members if a.node_id != self._me.node_id]
                await self.probe_round(others, ids)
            await asyncio.sleep(CHECK_SECONDS)

    async def probe_round(self, peers: list[Announcement], ids: tuple[str, ...]) -> None:
        """Measure the link to each of ``peers``, one at a time (a probe must not time its
        own neighbour); the round counts once every peer answered."""
        own = await self._timings(self._me)
        if own is None:
            return
        links: dict[NodeId, LinkProfile] = {}
        for peer in peers:
            timings = await self._timings(peer)
            if timings is None:
                return  # try again next check (it may be starting, or gone)
            links[peer.node_id] = self._link(peer, own, timings)
        self._links, self._round_for = links, ids
        if links:
            log.info(
                "links measured: %s",
                ", ".join(
                    f"{x.b} {x.all_sum_latency * 1e3:.2f} ms {x.all_sum_bandwidth / 1e6:.0f} MB/s"
                    for x in links.values()
                    if x.all_sum_latency and x.all_sum_bandwidth
                ),
            )

    async def _timings(self, peer: Announcement) -> tuple[float, float] | None:
        """(quickest empty round trip, quickest bulk round trip), seconds; None if it failed."""
        try:
            pings = [await self._echo(peer, 0) for _ in range(PINGS)]
            bulks = [await self._echo(peer, BULK_BYTES) for _ in range(BULKS)]
        except (aiohttp.ClientError, TimeoutError, OSError, PeerRefused) as error:
            log.debug("link probe of %s failed: %s", peer.node_id, error)
            return None
        return min(pings), min(bulks)

    async def _echo(self, peer: Announcement, size: int) -> float:
        start = time.perf_counter()
        await self._control.echo(peer, size)
        return time.perf_counter() - start

    def _link(
        self, peer: Announcement, own: tuple[float, float], timings: tuple[float, float]
    ) -> LinkProfile:
        ping, bulk = timings
        beyond = max(0.0, ping - own[0])
        return LinkProfile(
            a=self._me.node_id,
            b=peer.node_id,
            up=True,
            all_sum_latency=ALL_SUM_FLOOR + beyond,
            all_sum_bandwidth=BULK_BYTES / max(bulk - ping, 1e-6),
            send_recv_latency=ALL_SUM_FLOOR / 2 + beyond / 2,
            source="probe",
            measured_at=measured_now(),
        )
