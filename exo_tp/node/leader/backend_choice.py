"""Which MLX distributed backend a cluster epoch uses (pure).

`jaccl` (RDMA over Thunderbolt) needs a direct RDMA link between every pair of nodes and the
backend on every node; `ring` (TCP) works everywhere. "auto" takes jaccl when it can.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from exo_tp.errors import PlanError
from exo_tp.node.cluster.config import Requested

Backend = Literal["ring", "jaccl"]


@dataclass(frozen=True)
class BackendChoice:
    backend: Backend
    # jaccl: ibverbs device from rank i to rank j (None on the diagonal), in rank order
    ibv_devices: tuple[tuple[str | None, ...], ...] | None
    reason: str


def choose_backend(
    requested: Requested,
    nodes: Sequence[str],
    available: Mapping[str, Sequence[str]],
    rdma: Mapping[str, Mapping[str, str]],
) -> BackendChoice:
    """``nodes`` in rank order; ``available[n]``: backends node n can start; ``rdma[n][m]``:
    node n's RDMA device towards node m."""
    if requested == "ring" or len(nodes) == 1:
        return BackendChoice(
            "ring",
            None,
            "ring requested" if requested == "ring" else "a single node needs no backend",
        )
    missing_backend = [n for n in nodes if "jaccl" not in available.get(n, ())]
    missing_links = [
        f"{a}->{b}" for a in nodes for b in nodes if a != b and not rdma.get(a, {}).get(b)
    ]
    if not missing_backend and not missing_links:
        matrix = tuple(tuple(None if a == b else rdma[a][b] for b in nodes) for a in nodes)
        return BackendChoice("jaccl", matrix, "RDMA between every pair of nodes")
    why = (
        f"jaccl unavailable on {', '.join(missing_backend)}"
        if missing_backend
        else f"no RDMA link for {', '.join(missing_links[:4])}"
    )
    if requested == "jaccl":
        raise PlanError(f"cannot use jaccl: {why}")
    return BackendChoice("ring", None, f"ring over TCP ({why})")
