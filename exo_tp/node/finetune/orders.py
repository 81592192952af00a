"""Where a fine-tuning job's ranks get their rows of the frozen base: their own files, or a
transfer from the holders (exo_tp.weights.transfer.plan_shares)."""

from __future__ import annotations

import asyncio
import logging
import time

from exo_tp.finetune.boxes import finetune_boxes
from exo_tp.node.cluster.weight_orders import WeightOrder
from exo_tp.node.leader.cluster_model import ClusterModel, Prepared, transfer_orders
from exo_tp.node.member.peer_manifests import ManifestPending
from exo_tp.plan.finetune import FinetunePlan
from exo_tp.weights.transfer import plan_shares
from exo_tp.wire.announcement import Announcement
from exo_tp.wire.ids import NodeId

log = logging.getLogger(__name__)

MANIFEST_WAIT = 120.0  # seconds to wait for a holder's first manifest of the model


async def base_orders(
    models: ClusterModel, model: Prepared, members: list[Announcement], plan: FinetunePlan
) -> dict[NodeId, WeightOrder]:
    """Each member's WeightOrder for its rows of the frozen base (fetched where it lacks the
    files; a holder computes a folder's manifest once, the first time it is asked)."""
    deadline = time.monotonic() + MANIFEST_WAIT
    while True:  # a holder computes a folder's manifest once, the first time it is asked
        try:
            holdings = await models.holdings(model, members)
            break
        except ManifestPending:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(1.0)
    if holdings.manifest is None:  # every node has the files: each reads its rows there
        return {m.node_id: WeightOrder(key=model.key, name=model.name) for m in members}
    manifest = holdings.manifest
    shares = [finetune_boxes(manifest, plan, r) for r in range(len(members))]
    order = [m.node_id for m in members]
    transfer = plan_shares(manifest, shares, order, holdings.held)
    log.info(
        "fine-tuning: %.1f MB of base rows move, %.1f MB stay where they are",
        transfer.moved_bytes / 1e6,
        transfer.retained_bytes / 1e6,
    )
    return transfer_orders(model, transfer)
