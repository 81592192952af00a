"""The groups of the cluster as /v1/cluster shows them: on the leader, from each group's own
leader (load, pinned, idle time, keep-alive); elsewhere, from the leader's last status."""

from __future__ import annotations

import time

from exo_tp.node.cluster.control_messages import GroupSummary, NodeStatus
from exo_tp.node.cluster.views import GroupView
from exo_tp.node.joined import Joined


def led_group_views(joined: Joined) -> tuple[GroupView, ...]:
    """Every group this node leads, with an epoch."""
    groups, models = joined.groups, joined.models
    offers, pinned, now = models.offers(), joined.leader.pinned(), time.monotonic()
    views = []
    for leader in groups.leaders():
        led, key = leader.led, groups.key_of(leader)
        if led is None or key is None:
            continue
        d = leader.dispatcher
        busy = bool(d.in_flight or d.waiting)
        kept = leader.keep_alive_view(key)
        views.append(
            GroupView(
                group=leader.group,
                model=models.name_of(key, offers),
                key=key,
                replica=leader.slot.replica,
                state=led.state,
                ranks=led.nodes,
                pinned=key in pinned,
                in_flight=d.in_flight,
                waiting=d.waiting,
                idle_seconds=None if busy else round(now - d.last_active, 1),
                expires_in=kept.expires_in,
            )
        )
    return tuple(views)


def followed_group_views(joined: Joined, leader: NodeStatus | None) -> tuple[GroupView, ...]:
    """The groups as the leader's last status said (a node that does not lead)."""
    offers = joined.models.offers()
    return tuple(
        _summary_view(g, joined.models.name_of(g.model, offers))
        for g in (leader.groups if leader else ())
    )


def _summary_view(summary: GroupSummary, name: str) -> GroupView:
    return GroupView(
        group=summary.group,
        model=name,
        key=summary.model,
        replica=summary.replica,
        state=summary.state,
        ranks=summary.nodes,
    )
