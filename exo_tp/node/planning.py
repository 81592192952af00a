"""The cluster the planner sees, from the members' signed announcements."""

from __future__ import annotations

from collections.abc import Sequence

from exo_tp.node.announcement import Announcement
from exo_tp.plan.cluster import MEMORY_HEADROOM, Cluster, DeviceCost

# A member that announced no memory figure is not limited by the planner.
UNKNOWN_MEMORY = 1 << 50


def cluster_from_members(members: Sequence[Announcement], speeds: Sequence[float]) -> Cluster:
    """Devices at ``speeds`` (decode bytes/s for the model's weight format) with their
    announced prefill scores and memory; links are assumed (the planner's default LAN link):
    a cluster measures its links only once its workers run."""
    return Cluster(
        devices=tuple(
            DeviceCost(
                name=m.node_id,
                seconds_per_byte=1.0 / speed,
                prefill_flops=m.prefill_flops if m.prefill_flops > 0 else 1e9,
                memory=int(m.memory_available * MEMORY_HEADROOM)
                if m.memory_available
                else UNKNOWN_MEMORY,
            )
            for m, speed in zip(members, speeds, strict=True)
        )
    )
