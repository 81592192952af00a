"""Who is in the cluster, who is alive, and who leads (pure logic; time is passed in).

Leadership is deterministic and sticky: of the alive members that started together with the
longest-running one (within `SAME_START_S`), the smallest node id leads. A cluster started at
once is led by its smallest id; a member that restarts (a newer start) never takes the lead back
from the one that replaced it, which would throw away the epoch that one just formed. Every node
computes the leader from its own view; the leader additionally checks that all members agree
before it acts, so two leaders never assign ranks at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from exo_tp.wire.announcement import Announcement
from exo_tp.wire.ids import NodeId

MISSED_PINGS_DEAD = 3
# Starts this close count as one (a cluster started by one command, or by hand at once): the
# node id decides among them, so a cluster that starts together is led by its smallest id.
SAME_START_S = 10.0


@dataclass
class Member:
    announcement: Announcement
    last_seen: float
    missed_pings: int = 0

    @property
    def alive(self) -> bool:
        return self.missed_pings < MISSED_PINGS_DEAD


@dataclass
class Membership:
    me: Announcement
    members: dict[NodeId, Member] = field(default_factory=dict)
    changed_at: float = 0.0  # when the alive set last changed
    # when it last gained a member: the leader settles after joins (more may follow, as a
    # cluster starts), not after a departure, which it re-plans at once
    joined_at: float = 0.0

    def __post_init__(self) -> None:
        self.members[self.me.node_id] = Member(self.me, last_seen=float("inf"))

    def upsert(self, announcement: Announcement, now: float) -> bool:
        """Add or refresh a peer; True when the set of alive members changed."""
        if announcement.node_id == self.me.node_id:
            return False
        before = self.alive_ids()
        known = self.members.get(announcement.node_id)
        if known is None or known.announcement != announcement or not known.alive:
            self.members[announcement.node_id] = Member(announcement, last_seen=now)
        else:
            known.last_seen = now
        return self._changed(before, now)

    def remove(self, node_id: NodeId, now: float) -> bool:
        if node_id == self.me.node_id or node_id not in self.members:
            return False
        before = self.alive_ids()
        del self.members[node_id]
        return self._changed(before, now)

    def ping_result(self, node_id: NodeId, ok: bool, now: float, refused: bool = False) -> bool:
        """Count a status poll's outcome. ``refused``: the peer's host answered that nothing
        listens on its port (the daemon is gone, not slow nor cut off), so it is dead at once
        instead of after `MISSED_PINGS_DEAD` missed polls."""
        member = self.members.get(node_id)
        if member is None or node_id == self.me.node_id:
            return False
        before = self.alive_ids()
        if ok:
            member.missed_pings, member.last_seen = 0, now
        elif refused:
            member.missed_pings = max(member.missed_pings + 1, MISSED_PINGS_DEAD)
        else:
            member.missed_pings += 1
        return self._changed(before, now)

    def alive_ids(self) -> tuple[NodeId, ...]:
        return tuple(sorted(i for i, m in self.members.items() if m.alive))

    def alive(self) -> list[Announcement]:
        return [self.members[i].announcement for i in self.alive_ids()]

    def leader_id(self) -> NodeId:
        alive = self.alive()
        first = min(a.started for a in alive)
        return min(a.node_id for a in alive if a.started - first <= SAME_START_S)

    def get(self, node_id: NodeId) -> Announcement | None:
        member = self.members.get(node_id)
        return member.announcement if member else None

    def _changed(self, before: tuple[NodeId, ...], now: float) -> bool:
        after = self.alive_ids()
        if after == before:
            return False
        self.changed_at = now
        if set(after) - set(before):
            self.joined_at = now
        return True
