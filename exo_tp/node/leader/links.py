"""The links the members measured to each other, as the leader plans with them (and every
node's page shows them): the links in a member's profile to devices benched with it
(`exo-tp bench --peers`, relabelled to node ids), and each member's latest probe round
(exo_tp.node.member.link_probes). exo_tp.plan.cluster prefers the former where both exist."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import combinations

from exo_tp.node.cluster.control_messages import NodeStatus
from exo_tp.wire.ids import NodeId
from exo_tp.wire.profiles import LinkProfile

# How long after the membership settles the leader waits for every pair's probe before it
# plans with the default link for the pairs still missing (a probe takes well under 1 s).
LINK_WAIT = 10.0


def measured_links(statuses: Mapping[NodeId, NodeStatus | None]) -> tuple[LinkProfile, ...]:
    """Every link measured between two of the members whose ``statuses`` these are (None: a
    member not heard from), labelled by node id."""
    ids = set(statuses)
    node_of: dict[str, NodeId] = {}
    for node_id, status in statuses.items():
        if status is not None and status.profile is not None and status.profile.profile_id:
            node_of[status.profile.profile_id] = node_id
    out: list[LinkProfile] = []
    for status in statuses.values():
        if status is None:
            continue
        benched = status.profile.links if status.profile else ()
        for x in benched:
            a, b = node_of.get(x.a), node_of.get(x.b)
            if a is not None and b is not None and a != b:
                out.append(x.model_copy(update={"a": a, "b": b}))
        out += [x for x in status.probes if x.a in ids and x.b in ids]
    return tuple(out)


def unmeasured_pairs(
    links: Sequence[LinkProfile], members: Sequence[NodeId]
) -> list[tuple[NodeId, NodeId]]:
    """Pairs of ``members`` that no link measured."""
    have = {frozenset((x.a, x.b)) for x in links}
    return [(a, b) for a, b in combinations(sorted(members), 2) if frozenset((a, b)) not in have]
