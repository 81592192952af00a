"""Backend selection for a cluster epoch (pure)."""

from __future__ import annotations

import pytest

from exo_tp.errors import PlanError
from exo_tp.node.leader.backend_choice import choose_backend

NODES = ["a", "b", "c"]
MESH = {
    "a": {"b": "rdma_en2", "c": "rdma_en3"},
    "b": {"a": "rdma_en2", "c": "rdma_en4"},
    "c": {"a": "rdma_en3", "b": "rdma_en4"},
}
JACCL = {n: ["ring", "jaccl"] for n in NODES}


def test_full_rdma_mesh_uses_jaccl_with_rank_ordered_devices() -> None:
    choice = choose_backend("auto", ["c", "a", "b"], JACCL, MESH)
    assert choice.backend == "jaccl"
    assert choice.ibv_devices == (
        (None, "rdma_en3", "rdma_en4"),
        ("rdma_en3", None, "rdma_en2"),
        ("rdma_en4", "rdma_en2", None),
    )


def test_missing_link_falls_back_to_ring_and_says_why() -> None:
    partial = {**MESH, "c": {"a": "rdma_en3"}}
    choice = choose_backend("auto", NODES, JACCL, partial)
    assert choice.backend == "ring" and "c->b" in choice.reason
    with pytest.raises(PlanError, match="c->b"):
        choose_backend("jaccl", NODES, JACCL, partial)


def test_node_without_jaccl_means_ring() -> None:
    choice = choose_backend("auto", NODES, {**JACCL, "b": ["ring"]}, MESH)
    assert choice.backend == "ring" and "b" in choice.reason


def test_ring_on_request_and_for_one_node() -> None:
    assert choose_backend("ring", NODES, JACCL, MESH).backend == "ring"
    assert choose_backend("jaccl", ["a"], JACCL, MESH).backend == "ring"


def test_unmet_jaccl_request_fails_the_cluster_with_a_reason(default_models: dict) -> None:
    """Asked for jaccl without RDMA, a real cluster refuses to form and says why (503)."""
    import time

    from cluster_helpers import http_json, local_cluster
    from node_views import cluster_view

    with local_cluster(2, extra=("--backend", "jaccl"), ready=False) as cluster:
        deadline, view = time.monotonic() + 90, None
        while time.monotonic() < deadline:
            try:
                view = cluster_view(cluster.urls[1], timeout=2)
                if view.state == "failed":
                    break
            except OSError:
                pass
            time.sleep(0.5)
        assert view is not None and view.state == "failed", view
        assert "jaccl" in view.state_reason
        code, reply = http_json(
            f"{cluster.urls[0]}/v1/chat/completions",
            {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert code == 503 and "jaccl" in reply["error"]["message"]
