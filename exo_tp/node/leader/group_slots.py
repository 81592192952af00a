"""The groups a cluster serves: each is one model over a set of nodes (TP, stages or both), led
by its own `Leader` (exo_tp.node.leader.formation) with its own epochs and request source. The
main group serves the model requests ask for; every other group serves one more resident model,
or one replica of a model, over the nodes it is given. Pure values and choices."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from exo_tp.frozen import Frozen
from exo_tp.node.cluster.control_messages import MAIN_GROUP
from exo_tp.wire.ids import NodeId


class GroupSlot(Frozen):
    id: str = MAIN_GROUP
    key: str | None = None  # the model key it serves; None: the main group's, as asked
    nodes: frozenset[NodeId] | None = None  # the nodes it may use; None: every eligible one
    replica: int = 0  # which replica of its model (0: the first, or the only one)


MAIN_SLOT = GroupSlot()


def group_id(key: str, replica: int = 0) -> str:
    """A group's id: its model key, and its replica's number after the first."""
    return key if replica == 0 else f"{key}#{replica}"


def split_nodes(weights: Mapping[NodeId, float], count: int) -> tuple[frozenset[NodeId], ...]:
    """``count`` disjoint sets of nodes with about equal share weight each (the fastest node
    first into the lightest set), for replicas of one model; fewer where there are fewer
    nodes. Deterministic: ties go by node id."""
    sets: list[list[NodeId]] = [[] for _ in range(min(count, len(weights)))]
    totals = [0.0] * len(sets)
    for node in sorted(weights, key=lambda n: (-weights[n], n)):
        lightest = min(range(len(sets)), key=lambda i: (totals[i], i))
        sets[lightest].append(node)
        totals[lightest] += weights[node]
    return tuple(frozenset(s) for s in sets)


class Resident(Frozen):
    """A model held now (all its replicas together), as eviction sees it."""

    key: str
    pinned: bool
    last_active: float  # monotonic: when a request last started or ended on any replica
    bytes: int  # its weights, over every replica


def to_evict(
    models: Sequence[Resident], needed: int, free: int, max_models: int
) -> tuple[str, ...] | None:
    """The models to let go, least recently used first, so that one more of ``needed`` bytes
    fits in ``free`` bytes beside the rest and at most ``max_models`` are resident; None
    where letting every unpinned one go is not enough."""
    chosen: list[str] = []
    for model in sorted(models, key=lambda m: (m.last_active, m.key)):
        if needed <= free and len(models) - len(chosen) < max_models:
            break
        if not model.pinned:
            chosen.append(model.key)
            free += model.bytes
    if needed <= free and len(models) - len(chosen) < max_models:
        return tuple(chosen)
    return None
