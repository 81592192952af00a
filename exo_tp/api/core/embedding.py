"""Embeddings of the served model, for every dialect that asks (OpenAI's /v1/embeddings, Ollama's
/api/embed): each input one request through the batch (no token generated), the model's final
normed hidden state pooled at its last token (Qwen3-Embedding's pooling) and L2-normalized;
``dimensions`` keeps the first ones and normalizes again (Matryoshka, as those models are
trained).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence

from exo_tp.api.backend import Backend
from exo_tp.api.core.errors import ApiError
from exo_tp.api.core.generation import collect
from exo_tp.api.core.generation_request import request_id, token_budget
from exo_tp.api.http_io import off_loop
from exo_tp.wire.runtime import GenerateRequest, OutOfVocabulary, SamplingParams

MAX_INPUTS = 256  # inputs in one request


def _normalized(vector: Sequence[float], dimensions: int | None) -> list[float]:
    kept = list(vector[:dimensions] if dimensions else vector)
    norm = math.sqrt(sum(v * v for v in kept)) or 1.0
    return [v / norm for v in kept]


async def _tokens(node: Backend, value: str | list[int]) -> list[int]:
    if isinstance(value, list):
        return list(value)
    return list(await off_loop(node.tokenizer.encode, value))


async def _one(node: Backend, tokens: list[int], param: str) -> list[float]:
    if not tokens:
        raise ApiError(
            400, f"Invalid value for '{param}': an input encodes to no tokens.", param=param
        )
    token_budget(node, len(tokens), 1, param)  # the context holds it
    request = GenerateRequest(
        id=request_id("embd"),
        tokens=tuple(tokens),
        sampling=SamplingParams(max_tokens=0),
        embed="last",
    )
    try:
        request = request.fit(node.vocab_size)
    except OutOfVocabulary as error:
        raise ApiError(400, f"Invalid value for '{param}': {error}.", param=param) from None
    deltas, _ = await collect(node.generate(request))
    found = next((d.embedding for d in deltas if d.embedding), None)
    if found is None:
        raise ApiError(500, "the cluster gave no embedding")
    return list(found)


async def embed(
    node: Backend, inputs: Sequence[str | list[int]], dimensions: int | None, param: str
) -> tuple[list[list[float]], int]:
    """Each input's embedding (in order) and the tokens they took."""
    if not inputs:
        raise ApiError(400, f"Invalid value for '{param}': no input.", param=param)
    if len(inputs) > MAX_INPUTS:
        raise ApiError(400, f"Too many inputs: at most {MAX_INPUTS} per request.", param=param)
    token_lists = [await _tokens(node, value) for value in inputs]
    vectors = await asyncio.gather(*(_one(node, tokens, param) for tokens in token_lists))
    width = len(vectors[0])
    if dimensions is not None and not 0 < dimensions <= width:
        raise ApiError(
            400,
            f"Invalid value for 'dimensions': this model's embeddings have {width}.",
            param="dimensions",
        )
    return [_normalized(v, dimensions) for v in vectors], sum(len(t) for t in token_lists)
