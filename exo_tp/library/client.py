"""`exo_tp.Client(url, api_key=...)`: a running cluster's own routes, typed (health, the
cluster, its plan, its models, loading one); its OpenAI-compatible routes through the official
SDK (`Client.openai()`), whose requests any node answers.

Only the standard library speaks HTTP here: a script that reads a cluster's state needs no
event loop and no SDK.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel

from exo_tp.errors import ExoTpError

if TYPE_CHECKING:
    from exo_tp.api.model_list import ModelObject
    from exo_tp.node.cluster.views import ClusterView, HealthView, PlanView

View = TypeVar("View", bound=BaseModel)


class Client:
    """One node's API at ``url`` (http://host:8000); ``api_key``: the cluster's, if it has one."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 30.0):
        self.url, self.api_key, self.timeout = url.rstrip("/"), api_key, timeout

    def _call(self, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method="POST" if data else "GET"
        )
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        if self.api_key:
            request.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as error:
            raise ExoTpError(f"{path}: HTTP {error.code}: {_message(error)}") from None
        except (urllib.error.URLError, OSError) as error:
            reason = getattr(error, "reason", error)
            raise ExoTpError(f"cannot reach {self.url}: {reason}") from None

    def _view(self, path: str, kind: type[View]) -> View:
        return kind.model_validate(self._call(path))

    def health(self) -> HealthView:
        from exo_tp.node.cluster.views import HealthView

        return self._view("/health", HealthView)

    def cluster(self) -> ClusterView:
        """Members, devices, the served model and what each rank holds (`/v1/cluster`)."""
        from exo_tp.node.cluster.views import ClusterView

        return self._view("/v1/cluster", ClusterView)

    def plan(self) -> PlanView:
        """The plan the cluster serves with, and its prediction (`/v1/plan`)."""
        from exo_tp.node.cluster.views import PlanView

        return self._view("/v1/plan", PlanView)

    def models(self) -> list[ModelObject]:
        """`/v1/models`' cards (OpenAI's shape, with exo-tp's fields: loaded, parent)."""
        from exo_tp.api.model_list import ModelList

        return ModelList.model_validate(self._call("/v1/models")).data

    def load_model(self, model: str) -> dict[str, Any]:
        """Load ``model`` as a request naming it would (`/v1/models/load`)."""
        return dict(self._call("/v1/models/load", {"model": model}))

    def openai(self) -> Any:
        """An `openai.OpenAI` client of this node's OpenAI-compatible routes (needs the
        `openai` package)."""
        try:
            import openai
        except ImportError:
            raise ExoTpError(
                "Client.openai() needs the openai package (pip install openai)"
            ) from None
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none")


def _message(error: urllib.error.HTTPError) -> str:
    """The API's error message (OpenAI-style JSON), else the reason."""
    try:
        body = json.loads(error.read())
        return str(body["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return str(error.reason)
