"""Ollama's /api/embed (and the older /api/embeddings): exo_tp.api.core.embedding computes them."""

from __future__ import annotations

import time

from aiohttp import web
from pydantic import Field

from exo_tp.api.backend import Backend
from exo_tp.api.core.embedding import embed
from exo_tp.api.core.generation_request import check_model
from exo_tp.api.core.strict import Passed
from exo_tp.api.http_io import read_body, validate
from exo_tp.api.ollama.schema import LATEST


class EmbedRequest(Passed):
    model: str | None = None
    input: str | list[str] = Field(default_factory=list)
    prompt: str | None = None  # /api/embeddings' one input
    truncate: bool = True  # an input over the context is an error here either way
    dimensions: int | None = Field(default=None, ge=1)

    def inputs(self) -> list[str | list[int]]:
        if self.prompt is not None:
            return [self.prompt]
        return [self.input] if isinstance(self.input, str) else list(self.input)


async def embed_route(node: Backend, request: web.Request, legacy: bool) -> web.Response:
    started = time.perf_counter()
    parsed = validate(EmbedRequest, await read_body(request))
    node = check_model(node, parsed.model.removesuffix(LATEST) if parsed.model else None)
    vectors, tokens = await embed(node, parsed.inputs(), parsed.dimensions, "input")
    if legacy:  # /api/embeddings: one input, one "embedding"
        return web.json_response({"embedding": vectors[0]})
    took = int((time.perf_counter() - started) * 1e9)
    return web.json_response(
        {
            "model": parsed.model or node.model,
            "embeddings": vectors,
            "total_duration": took,
            "load_duration": 0,
            "prompt_eval_count": tokens,
        }
    )
