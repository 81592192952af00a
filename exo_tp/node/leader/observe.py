"""What a group's leader reads of its cluster each round (the membership and statuses from the
peers' poll, the load from its dispatcher), and how it names a peer that failed a round."""

from __future__ import annotations

import aiohttp

from exo_tp.node.cluster.peers import POLL_SECONDS, Peers
from exo_tp.node.leader.dispatch import Dispatcher
from exo_tp.node.leader.state import ClusterSeen
from exo_tp.wire.announcement import Announcement


def cluster_seen(peers: Peers, dispatcher: Dispatcher, group: str) -> ClusterSeen:
    """The alive members, each one's status as ``group``'s leader reads it (that group's
    worker), which statuses are recent, and the group's load."""
    alive = peers.alive()
    statuses = {m.node_id: s.for_group(group) for m in alive if (s := peers.status(m.node_id))}
    recent = (m.node_id for m in alive if peers.status(m.node_id, max_age=3 * POLL_SECONDS))
    return ClusterSeen(
        members=tuple(alive),
        statuses=statuses,
        fresh=frozenset(recent),
        joined_at=peers.joined_at,
        changed_at=peers.changed_at,
        in_flight=dispatcher.in_flight,
        waiting=dispatcher.waiting,
        last_active=dispatcher.last_active,
    )


def client_reason(error: BaseException, alive: list[Announcement]) -> str:
    """What clients are told of a failed round: a peer that did not answer is named by its
    node id, never by the internal address in the error (the log keeps that)."""
    if isinstance(error, aiohttp.ClientConnectorError):
        for member in alive:
            if (member.host, member.control_port) == (error.host, error.port):
                return f"node {member.node_id} did not answer"
        return "a member did not answer"
    if isinstance(error, aiohttp.ClientError | TimeoutError | OSError):
        return f"a member did not answer ({type(error).__name__})"
    return str(error) or type(error).__name__
