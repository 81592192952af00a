"""The groups of the cluster as /v1/cluster shows them: on the leader, from each group's own
leader (exo_tp.node.leader.resident); elsewhere, as the leader's last status carried them."""

from __future__ import annotations

from exo_tp.node.cluster.control_messages import GroupView, NodeStatus
from exo_tp.node.joined import Joined


def group_views(joined: Joined, leader: NodeStatus | None) -> tuple[GroupView, ...]:
    """The groups: this node's own where it leads, else the leader's last status's."""
    if joined.leads():
        return joined.groups.views_now()
    return leader.groups if leader else ()
