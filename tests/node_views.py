"""A node's views (/health, /v1/cluster, /v1/plan), read over HTTP into their typed models."""

from __future__ import annotations

from cluster_helpers import http_json

from exo_tp.node.cluster.views import ClusterView, HealthView, PlanView


def health(url: str, timeout: float = 5) -> HealthView:
    return HealthView.model_validate(http_json(f"{url}/health", timeout=timeout)[1])


def cluster_view(url: str, timeout: float = 5) -> ClusterView:
    return ClusterView.model_validate(http_json(f"{url}/v1/cluster", timeout=timeout)[1])


def plan_view(url: str, timeout: float = 5, headers: dict[str, str] | None = None) -> PlanView:
    return PlanView.model_validate(http_json(f"{url}/v1/plan", timeout=timeout, headers=headers)[1])
