"""The dispatcher's domain errors reach clients as the HTTP errors they always got: status,
OpenAI-style body and Retry-After, written out here as the API sent them before the dispatcher
stopped speaking HTTP (the node's API backend is the one place that maps them)."""

from __future__ import annotations

from exo_tp.node.api_errors import api_error
from exo_tp.node.leader.dispatch import ClusterLost, GenerationFailed, NotReady, QueueFull


def _error(message: str, code: str, kind: str = "server_error") -> dict[str, object]:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


def test_queue_full_is_a_429_with_retry_after() -> None:
    error = api_error(QueueFull(running=4, waiting=9))
    assert error.status == 429 and error.headers() == {"Retry-After": "2"}
    assert error.body() == _error(
        "the cluster is busy: 4 requests running and 9 waiting; retry later",
        "queue_full",
        "requests",  # OpenAI's rate-limit type (issue #45: it was server_error)
    )
    assert api_error(QueueFull(running=8, waiting=3)).headers() == {"Retry-After": "1"}


def test_not_ready_is_a_503_with_retry_after() -> None:
    error = api_error(NotReady("the cluster is forming"))
    assert error.status == 503 and error.headers() == {"Retry-After": "5"}
    assert error.body() == _error("cluster not ready: the cluster is forming", "cluster_not_ready")


def test_failures_while_generating() -> None:
    failed = api_error(GenerationFailed("rank 1: out of memory"))
    assert failed.status == 500 and failed.headers() == {}
    assert failed.body() == _error("generation failed: rank 1: out of memory", "generation_failed")
    lost = api_error(ClusterLost("leadership moved"))
    assert lost.status == 503 and lost.headers() == {}
    assert lost.body() == _error("generation failed: leadership moved", "cluster_failure")
