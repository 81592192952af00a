"""Every member's Assignment of a new epoch, from the placement and where each member listens
(pure: the leader asks the members for fresh ports first)."""

from __future__ import annotations

from exo_tp.frozen import Frozen, replace
from exo_tp.node.cluster.config import NodeConfig
from exo_tp.node.cluster.control_messages import Ports
from exo_tp.node.leader.backend_choice import BackendChoice
from exo_tp.node.leader.placement import Placement
from exo_tp.plan.cluster import MEMORY_HEADROOM
from exo_tp.plan.kv_width import kv_token_capacity
from exo_tp.plan.step_budget import attention_ratio, step_token_budget
from exo_tp.wire.announcement import Announcement
from exo_tp.wire.assignment import DTYPE_BYTES, Assignment
from exo_tp.wire.ids import Epoch, Rank


class Where(Frozen):
    """Where an epoch's ranks meet: each member (in rank order) and its fresh ports, and the
    leader's request source."""

    members: tuple[Announcement, ...]
    ports: tuple[Ports, ...]
    requests_at: str  # "ip:port"


def assignments_of(
    number: Epoch,
    model: str,
    placement: Placement,
    where: Where,
    backend: BackendChoice,
    config: NodeConfig,
) -> list[Assignment]:
    """Each rank's Assignment of epoch ``number``."""
    plan, members, ports = placement.plan, where.members, where.ports
    ranks = range(len(members))
    hops = tuple(f"{members[r].host}:{ports[r].hop}" for r in ranks) if len(plan.stages) > 1 else ()
    conductor = plan.stages[-1].ranks[0]
    serving = config.serving
    if serving.step_token_budget is None and placement.prediction is not None:
        size, gap = serving.prefill_step_size, serving.prefill_gap
        budget = step_token_budget(placement.prediction, size, gap)
        ratio = attention_ratio(plan.spec)
        serving = replace(serving, step_token_budget=budget, chunk_attention_ratio=ratio)
    return [
        Assignment(
            epoch=number,
            model=model,
            plan=plan,
            rank=Rank(rank),
            hostfile=tuple(f"{members[r].host}:{ports[r].ring}" for r in ranks),
            conductor=f"{members[conductor].host}:{ports[conductor].conductor}",
            requests_at=where.requests_at,
            hops=hops,
            nodes=placement.rank_order,
            dtype=config.dtype,
            backend=backend.backend,
            ibv_devices=backend.ibv_devices,
            prediction=placement.prediction,
            serving=serving,
            adapter_path=config.adapter_path,
            speed_probe=config.rebalance and len(plan.stages) == 1 and len(members) > 1,
        )
        for rank in ranks
    ]


def kv_tokens(placement: Placement, eligible: list[Announcement], config: NodeConfig) -> int | None:
    """Tokens of context the plan's KV memory holds (exo_tp.plan.kv_width), all streams
    together, from each rank's node's available memory (as the planner counts it) less the
    recurrent state of a full batch."""
    serving, by_id = config.serving, {m.node_id: m for m in eligible}
    free = [
        int(by_id[n].memory_available * MEMORY_HEADROOM) if by_id[n].memory_available else 2**62
        for n in placement.rank_order
    ]
    return kv_token_capacity(
        placement.plan,
        free,
        DTYPE_BYTES[config.dtype],
        serving.kv_bits,
        serving.kv_group_size,
        serving.kv_cache_bytes,
        # every stream the batch may run keeps its recurrent state (hybrid families)
        streams=serving.max_concurrency,
    )
