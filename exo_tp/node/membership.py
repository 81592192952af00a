"""Who is in the cluster, who is alive, and who leads (pure logic; time is passed in).

Leadership is deterministic: the alive member with the smallest node id leads. Every node
computes it from its own view; the leader additionally checks that all members agree before it
acts, so two leaders never assign ranks at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from exo_tp.wire.announcement import Announcement
from exo_tp.wire.ids import NodeId

MISSED_PINGS_DEAD = 3


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
    changed_at: float = 0.0

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

    def ping_result(self, node_id: NodeId, ok: bool, now: float) -> bool:
        member = self.members.get(node_id)
        if member is None or node_id == self.me.node_id:
            return False
        before = self.alive_ids()
        if ok:
            member.missed_pings, member.last_seen = 0, now
        else:
            member.missed_pings += 1
        return self._changed(before, now)

    def alive_ids(self) -> tuple[NodeId, ...]:
        return tuple(sorted(i for i, m in self.members.items() if m.alive))

    def alive(self) -> list[Announcement]:
        return [self.members[i].announcement for i in self.alive_ids()]

    def leader_id(self) -> NodeId:
        return self.alive_ids()[0]

    def get(self, node_id: NodeId) -> Announcement | None:
        member = self.members.get(node_id)
        return member.announcement if member else None

    def _changed(self, before: tuple[NodeId, ...], now: float) -> bool:
        if self.alive_ids() != before:
            self.changed_at = now
            return True
        return False
