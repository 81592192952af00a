"""The HTTP errors a node's failures become: the one place that words them (the node's API
backend, exo_tp.node.backend, raises them)."""

from __future__ import annotations

from exo_tp.api.core.errors import ApiError, not_ready
from exo_tp.node.leader.dispatch import (
    ClusterLost,
    DispatchError,
    GenerationFailed,
    KvCacheFull,
    NotReady,
    QueueFull,
)
from exo_tp.node.leader.resident import TooLarge


def api_error(error: DispatchError) -> ApiError:
    """The HTTP error a client gets for a dispatch failure."""
    if isinstance(error, QueueFull):
        return ApiError(
            429,
            f"the cluster is busy: {error.running} requests "
            f"running and {error.waiting} waiting; retry later",
            code="queue_full",
            retry_after=error.retry_after,
        )
    if isinstance(error, KvCacheFull):
        return ApiError(
            429,
            f"the cluster's KV cache is full: this request's context needs {error.needed} "
            f"tokens and running requests hold {error.reserved} of {error.capacity}; "
            "retry later",
            code="kv_cache_full",
            retry_after=1,
        )
    if isinstance(error, NotReady):
        return not_ready(error.reason)
    if isinstance(error, GenerationFailed):
        return ApiError(
            500,
            # the grammar's reason alone: the API words it as the schema's error
            error.message if error.grammar else f"generation failed: {error.message}",
            kind="server_error",
            code="grammar_failed" if error.grammar else "generation_failed",
        )
    if isinstance(error, ClusterLost):
        return ApiError(
            503, f"generation failed: {error.reason}", kind="server_error", code="cluster_failure"
        )
    return ApiError(500, f"generation failed: {error}", kind="server_error")


def model_loading(name: str) -> ApiError:
    return ApiError(
        503,
        f"loading the model '{name}'; retry shortly",
        kind="server_error",
        code="model_loading",
        retry_after=10,
    )


def too_large(name: str, wanted: TooLarge) -> ApiError:
    """A model the cluster's memory cannot hold beside the pinned models."""
    beside = f" beside the pinned {', '.join(wanted.pinned)}" if wanted.pinned else ""
    return ApiError(
        400,
        f"The model '{name}' needs {wanted.needed / 1e9:.2f} GB for its weights; the cluster's "
        f"memory holds {max(0, wanted.free) / 1e9:.2f} GB for it{beside}.",
        param="model",
        code="model_too_large",
    )
