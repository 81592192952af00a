"""What the public API needs from the node that serves it (the node implements this)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Protocol

from mlx_lm.tokenizer_utils import TokenizerWrapper
from pydantic import BaseModel

from exo_tp.api.core.defaults import GenerationDefaults
from exo_tp.api.finetune_api import FineTuningService
from exo_tp.api.model_list import ModelObject
from exo_tp.api.proxy import Upstream
from exo_tp.wire.runtime import Delta, Done, GenerateRequest

if TYPE_CHECKING:
    from exo_tp.vision.families import NoImages
    from exo_tp.vision.prompt import ImagePrompter


class Backend(Protocol):
    # Read-only for the API (properties here: the node may hold them as attributes or compute
    # them, and its narrower types, such as a NodeId for the str, still fit).
    @property
    def node_id(self) -> str: ...
    @property
    def model(self) -> str:
        """The model id this cluster serves now."""

    @property
    def tokenizer(self) -> TokenizerWrapper: ...
    @property
    def images(self) -> ImagePrompter | NoImages | None:
        """The model's image processor; None when it takes no images."""

    @property
    def context_length(self) -> int: ...
    @property
    def vocab_size(self) -> int:
        """The model's logits width: valid token ids are below it."""

    @property
    def defaults(self) -> GenerationDefaults:
        """What a request that omits a field gets."""

    @property
    def started(self) -> float:
        """Unix time the node started."""

    @property
    def fine_tuning(self) -> FineTuningService:
        """OpenAI's files and fine-tuning jobs (exo_tp.api.finetune_api)."""

    def health(self) -> BaseModel:
        """/health: this node's state and its worker's (incl. a stall), as a typed view (the
        API sends its JSON; the node defines its shape)."""

    def serving_state(self) -> str:
        """forming, loading, ready, failed or unknown."""

    def leader_id(self) -> str | None: ...

    def generation_upstream(self) -> Upstream | None:
        """Where requests go when another node runs generation: that node's id and cluster
        listener, under `exo_tp.api.core.errors.FORWARD_PREFIX` (requests are passed through to
        it, signed by `forward_headers`); None when this node runs it."""

    def forward_headers(self, path: str, body: bytes) -> dict[str, str]:
        """Headers proving to the leader's cluster listener that a passed-on request comes
        from a member (the signature over ``path`` and ``body``)."""

    def models_view(self) -> list[ModelObject]:
        """/v1/models' entries: every model some node of the cluster can serve."""

    def for_model(self, name: str) -> Backend:
        """The backend that serves requests for ``name`` (its tokenizer, context, group), or
        `ApiError`: 404 for a model no node has, 503 with Retry-After while the cluster loads
        it, 4xx for one that cannot fit the cluster's memory."""

    def cluster_view(self) -> BaseModel:
        """/v1/cluster: the members, the model served, the epoch's ranks and links."""

    async def plan_view(self) -> BaseModel:
        """/v1/plan: the epoch's plan and the cost model's prediction."""

    def model_catalog(self) -> BaseModel:
        """The model picker's list: every model the cluster can serve, its fit and predicted
        speed, and the hub downloads under way."""

    async def load_model(self, name: str) -> BaseModel:
        """Serve ``name`` next (what a request naming it does; a hub id is downloaded first);
        raises `ApiError` for a model that cannot be had."""

    async def unload_model(self, name: str) -> BaseModel:
        """Let the served model go now if a request naming ``name`` runs on it; the next
        request naming a model loads it again."""

    def keep_alive(self, seconds: float) -> None:
        """A request asked the served model to stay loaded ``seconds`` once idle (0: unload it
        as soon as nothing runs; negative: for ever)."""

    def resident(self, name: str) -> tuple[int | None, float | None]:
        """Of a resident model: its context (None where this node cannot tell) and the
        seconds until it is let go if nothing runs (None: never)."""

    def generate(self, request: GenerateRequest) -> AsyncGenerator[Delta | Done, None]:
        """The events of one generation; raises `ApiError` (503 while the cluster is not
        ready, 429 when the queue is full); closing the iterator early cancels it."""
