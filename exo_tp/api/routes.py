"""The public HTTP API of a node: OpenAI-compatible generation, cluster and plan views.

Every node serves it. Generation runs on the leader (its worker is rank 0); other nodes pass
generation requests through to the leader unchanged, streaming included.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web
from pydantic import ValidationError

from exo_tp.api.access import ApiAccess
from exo_tp.api.backend import Backend
from exo_tp.api.errors import ApiError
from exo_tp.api.guard import install_guard
from exo_tp.api.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    validation_error,
)
from exo_tp.api.proxy import pass_through
from exo_tp.runtime.messages import Delta, Done, GenerateRequest, SamplingParams

log = logging.getLogger(__name__)

MAX_BODY = 4 * 1024 * 1024
DEFAULT_MAX_TOKENS = 512
BACKEND_KEY = web.AppKey("backend", object)


def error_response(error: ApiError) -> web.Response:
    return web.json_response(error.body(), status=error.status, headers=error.headers())


@web.middleware
async def json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every failure leaves as OpenAI-style JSON; the node keeps serving."""
    try:
        return await handler(request)
    except ApiError as error:
        return error_response(error)
    except web.HTTPException as http:
        if http.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
        return error_response(ApiError(http.status, http.reason or "error",
                                       code=code.get(http.status)))
    except Exception:
        log.exception("internal error on %s", request.path)
        return error_response(ApiError(500, "internal server error", kind="server_error"))


def build_public_app(backend: Backend, extra_routes: web.RouteTableDef,
                     access: ApiAccess | None = None) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY, middlewares=[json_errors])
    install_guard(app, access or ApiAccess())
    app[BACKEND_KEY] = backend
    app.add_routes(ROUTES)
    app.add_routes(extra_routes)
    return app


def _node(request: web.Request) -> Backend:
    return request.app[BACKEND_KEY]  # type: ignore[return-value]


ROUTES = web.RouteTableDef()


@ROUTES.get("/health")
async def health(request: web.Request) -> web.Response:
    return web.json_response(_node(request).health())


@ROUTES.get("/v1/models")
async def models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": _node(request).models_view()})


@ROUTES.get("/v1/cluster")
async def cluster(request: web.Request) -> web.Response:
    return web.json_response(_node(request).cluster_view())


@ROUTES.get("/v1/plan")
async def plan(request: web.Request) -> web.Response:
    return web.json_response(await _node(request).plan_view())


async def _read_json(request: web.Request) -> Any:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"request body larger than {MAX_BODY} bytes",
                       code="request_too_large") from None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as bad:
        raise ApiError(400, f"request body is not valid JSON: {bad}") from None


def _validate(model: type[ChatCompletionRequest] | type[CompletionRequest], body: Any) -> Any:
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as error:
        raise validation_error(error) from None


def _prompt_tokens(node: Backend, request: ChatCompletionRequest | CompletionRequest) -> list[int]:
    tokenizer = node.tokenizer
    if isinstance(request, CompletionRequest):
        return tokenizer.encode(request.prompt_text(), add_special_tokens=True)
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in request.messages]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True)
    except Exception as error:  # the model's template may reject a conversation's shape
        raise ApiError(400, f"the chat template rejected the messages: {error}",
                       param="messages") from None
    return tokenizer.encode(text, add_special_tokens=False)


def _generation(node: Backend, request: ChatCompletionRequest | CompletionRequest,
                kind: str) -> GenerateRequest:
    node.require_model(request.model)
    tokens = _prompt_tokens(node, request)
    context = node.context_length
    wanted = request.requested_max_tokens()
    if len(tokens) >= context:
        raise ApiError(400, f"This model's maximum context length is {context} tokens; the "
                            f"prompt has {len(tokens)}.", param="messages",
                       code="context_length_exceeded")
    if wanted is not None and len(tokens) + wanted > context:
        raise ApiError(400, f"This model's maximum context length is {context} tokens; you "
                            f"requested {len(tokens) + wanted} ({len(tokens)} in the prompt, "
                            f"{wanted} to generate).", param="max_tokens",
                       code="context_length_exceeded")
    max_tokens = wanted or min(DEFAULT_MAX_TOKENS, context - len(tokens))
    sampling = SamplingParams(max_tokens=max_tokens, temperature=request.temperature,
                              top_p=request.top_p, seed=request.seed)
    return GenerateRequest(id=f"{kind}-{uuid.uuid4().hex[:24]}", tokens=tuple(tokens),
                           sampling=sampling, stop=tuple(request.stop_list()))


def _usage(done: Done) -> dict[str, Any]:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_tokens}}


def _finish(done: Done) -> str:
    return "stop" if done.finish_reason in ("stop", "cancelled") else "length"


class _Shape:
    """The small differences between chat and plain completions."""

    def __init__(self, chat: bool, request_id: str, model: str):
        self.chat, self.id, self.model = chat, request_id, model
        self.created = int(time.time())

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, text: str | None, finish: str | None, first: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            return {**self._base("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
        return {**self._base("text_completion"), "choices": [choice]}

    def usage_chunk(self, done: Done) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._base(obj), "choices": [], "usage": _usage(done)}

    def whole(self, text: str, done: Done) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": _finish(done), "logprobs": None}
            return {**self._base("chat.completion"), "choices": [choice], "usage": _usage(done)}
        choice = {"index": 0, "text": text, "finish_reason": _finish(done), "logprobs": None}
        return {**self._base("text_completion"), "choices": [choice], "usage": _usage(done)}


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    node = _node(request)
    upstream = node.generation_url()
    if upstream is not None:
        return await _pass_to_leader(request, upstream)
    body = await _read_json(request)
    parsed = _validate(ChatCompletionRequest if chat else CompletionRequest, body)
    generation = _generation(node, parsed, "chatcmpl" if chat else "cmpl")
    shape = _Shape(chat, generation.id, node.model)
    events = node.generate(generation)
    if parsed.stream:
        include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
        return await _stream(request, events, shape, include_usage)
    text, done = [], None
    async for event in events:
        if isinstance(event, Delta):
            text.append(event.text)
        else:
            done = event
    assert done is not None
    return web.json_response(shape.whole("".join(text), done))


async def _stream(request: web.Request, events: AsyncIterator[Delta | Done], shape: _Shape,
                  include_usage: bool) -> web.StreamResponse:
    # The first event decides between a JSON error (nothing sent yet) and a stream.
    first = await anext(events)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)

    async def send(payload: dict[str, Any] | str) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload)
        await response.write(f"data: {data}\n\n".encode())

    try:
        await send(shape.chunk("" if shape.chat else None, None, first=True))
        event: Delta | Done = first
        while True:
            if isinstance(event, Delta):
                await send(shape.chunk(event.text, None))
            else:
                await send(shape.chunk(None if shape.chat else "", _finish(event)))
                if include_usage:
                    await send(shape.usage_chunk(event))
                await send("[DONE]")
                break
            event = await anext(events)
    except ApiError as error:  # mid-stream failure: an error event, then the stream ends
        await send(error.body())
    finally:
        await events.aclose()
    await response.write_eof()
    return response


@ROUTES.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


@ROUTES.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def _pass_to_leader(request: web.Request, upstream_url: str) -> web.StreamResponse:
    body = await _read_json(request)  # malformed bodies are refused here already
    return await pass_through(request, upstream_url + request.path, body)
