"""OpenAI's /v1/embeddings (exo_tp.api.core.embedding computes them)."""

from __future__ import annotations

import base64
import struct
from typing import Literal

from aiohttp import web
from pydantic import Field

from exo_tp.api.backend import Backend
from exo_tp.api.core.embedding import embed
from exo_tp.api.core.generation_request import check_model
from exo_tp.api.core.strict import Strict
from exo_tp.api.http_io import ApiView, json_view, read_body, validate


class EmbeddingRequest(Strict):
    model: str | None = None  # omitted: the served model
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None  # bookkeeping: changes nothing

    def inputs(self) -> list[str | list[int]]:
        if isinstance(self.input, str):
            return [self.input]
        if self.input and isinstance(self.input[0], int):
            return [list(self.input)]  # type: ignore[arg-type]
        return list(self.input)  # type: ignore[arg-type]


class EmbeddingObject(ApiView):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # base64: little-endian float32s, as OpenAI sends them


class EmbeddingUsage(ApiView):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(ApiView):
    object: Literal["list"]
    data: list[EmbeddingObject]
    model: str
    usage: EmbeddingUsage


def _encoded(vector: list[float], form: str) -> list[float] | str:
    if form == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


async def embeddings(node: Backend, request: web.Request) -> web.StreamResponse:
    parsed = validate(EmbeddingRequest, await read_body(request))
    node = check_model(node, parsed.model)
    vectors, tokens = await embed(node, parsed.inputs(), parsed.dimensions, "input")
    data = [
        EmbeddingObject(object="embedding", index=i, embedding=_encoded(v, parsed.encoding_format))
        for i, v in enumerate(vectors)
    ]
    usage = EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)
    return json_view(EmbeddingList(object="list", data=data, model=node.model, usage=usage))
