"""Where the main model's replicas run: ``--replicas N`` splits the eligible nodes into N sets of
about equal share weight; ``--replicas auto`` asks the planner (exo_tp.plan.replicas) to compare
one group over every node with 2, 3 ... replicas over disjoint sets, by the cost model, for the
serving objective at the load seen now, and says why. Without every node's profile the planner
cannot price them: one group then."""

from __future__ import annotations

import asyncio
import logging

from exo_tp.errors import ExoTpError
from exo_tp.node.leader.formation import Leader
from exo_tp.node.leader.group_slots import split_nodes
from exo_tp.node.leader.placement import planner_cluster
from exo_tp.plan.replicas import choose_replicas
from exo_tp.wire.ids import NodeId

log = logging.getLogger(__name__)

Sets = tuple[frozenset[NodeId], ...]


def share_weights(main: Leader, nodes: list[NodeId]) -> dict[NodeId, float]:
    """Each node's share weight: its --weight, else its announced decode speed."""
    out: dict[NodeId, float] = {}
    for node in nodes:
        member = main.peers.get(node)
        if member is None:
            continue
        speed = 1 / member.decode_seconds_per_byte if member.decode_seconds_per_byte else 1.0
        out[node] = member.weight if member.weight > 0 else speed
    return out


async def replica_sets(main: Leader, key: str, nodes: list[NodeId], count: int) -> Sets:
    """The node sets of the main model's replicas (``count`` 0: the planner's choice)."""
    if count > 0:
        return split_nodes(share_weights(main, nodes), count)
    try:
        model = await main.models.prepare(key, nodes, main=False)
        eligible = [a for a in main.peers.alive() if a.node_id in nodes]
        me = main.peers.status(main.me)
        facts = main.members_for(model.spec, eligible, me.profile if me else None)
        cluster = planner_cluster(model.spec, facts)
        objective = main.config.serving.objective
        choice = await asyncio.to_thread(
            choose_replicas, model.spec, cluster, objective, main.queue
        )
    except (ExoTpError, ValueError) as error:
        log.info("replicas auto: one group over every node (%s)", error)
        return (frozenset(nodes),)
    log.info("replicas auto for %s: %s", model.name, choice.reason)
    ids = [m.node_id for m in facts.members]
    return tuple(frozenset(ids[d] for d in subset) for subset in choice.best.subsets)
