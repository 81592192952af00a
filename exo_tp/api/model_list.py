"""The served models' list (``/v1/models``, in OpenAI's shape): what the `Backend` reports, which
every dialect's model views read (Ollama's tags and ps included)."""

from __future__ import annotations

from typing import Literal

from exo_tp.api.http_io import ApiView


class ModelObject(ApiView):
    """One entry of /v1/models (OpenAI's model object, and whether the cluster serves it now);
    a fine-tuned model also names its ``parent``."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    loaded: bool
    parent: str | None = None  # left out of a base model's entry (unset)
    # ["vision"] for a model that takes images (left out of a text model's entry)
    capabilities: list[str] | None = None

    @classmethod
    def of(
        cls,
        name: str,
        created: int,
        loaded: bool,
        parent: str | None = None,
        vision: bool = False,
    ) -> ModelObject:
        card = cls(id=name, object="model", created=created, owned_by="exo-tp", loaded=loaded)
        if parent is not None:
            card.parent = parent  # set, so the JSON has it
        if vision:
            card.capabilities = ["vision"]
        return card


class ModelList(ApiView):
    object: Literal["list"]
    data: list[ModelObject]
