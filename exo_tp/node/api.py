"""The public HTTP API of a node: OpenAI-compatible generation, cluster and plan views.

Every node serves it. Generation runs on the leader (its worker is rank 0); other nodes pass
generation requests through to the leader unchanged, streaming included.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web
from pydantic import ValidationError

from exo_tp.node.dispatcher import Delta, Done
from exo_tp.node.openai_schema import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    validation_error,
)
from exo_tp.plan.pipeline import PipelinePlan
from exo_tp.plan.predict import Prediction
from exo_tp.runtime.job import GenerateRequest, SamplingParams

if TYPE_CHECKING:
    from exo_tp.node.daemon import Node

log = logging.getLogger(__name__)

MAX_BODY = 4 * 1024 * 1024
DEFAULT_MAX_TOKENS = 512
NODE_KEY = web.AppKey("node", object)


def error_response(error: ApiError) -> web.Response:
    return web.json_response(error.body(), status=error.status)


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


def build_public_app(node: Node, extra_routes: web.RouteTableDef) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY, middlewares=[json_errors])
    app[NODE_KEY] = node
    app.add_routes(ROUTES)
    app.add_routes(extra_routes)
    return app


def _node(request: web.Request) -> Node:
    return request.app[NODE_KEY]  # type: ignore[return-value]


ROUTES = web.RouteTableDef()


@ROUTES.get("/health")
async def health(request: web.Request) -> web.Response:
    node = _node(request)
    return web.json_response({"status": "ok", "node_id": node.me, "state": node.serving_state(),
                              "leader": node.membership.leader_id() if node.membership else None})


@ROUTES.get("/v1/models")
async def models(request: web.Request) -> web.Response:
    node = _node(request)
    return web.json_response({"object": "list", "data": [
        {"id": node.config.model, "object": "model", "created": int(node.started),
         "owned_by": "exo-tp"}]})


@ROUTES.get("/v1/cluster")
async def cluster(request: web.Request) -> web.Response:
    return web.json_response(_node(request).cluster_view())


@ROUTES.get("/v1/plan")
async def plan(request: web.Request) -> web.Response:
    node = _node(request)
    assignment = node.assignment
    if assignment is None:
        # A node the planner left out holds no rank but still shows the cluster's plan.
        leader = node.leader()
        if leader is not None and not node.is_leader():
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                timeout = aiohttp.ClientTimeout(total=3)
                async with aiohttp.ClientSession(timeout=timeout) as session, \
                        session.get(leader.api_url + "/v1/plan") as upstream:
                    view = await upstream.json()
                    if view.get("nodes"):
                        return web.json_response(view)
        return web.json_response({"epoch": None, "state": node.serving_state(), "plan": None,
                                  "nodes": []})
    return web.json_response({
        "epoch": assignment.epoch, "state": node.serving_state(), "model": assignment.model,
        "nodes": list(assignment.nodes), **plan_view(assignment.plan, assignment.prediction),
    })


def plan_view(plan: PipelinePlan, prediction: Prediction | None = None) -> dict[str, Any]:
    """The plan as /v1/plan shows it: stages (ranks, layers, each stage's TP plan) and, with
    one stage (the common case), that tensor-parallel plan as ``plan``; with the planner's
    prediction, ``predicted`` (null when shares were set by hand)."""
    stages = [{"ranks": list(s.ranks), "layers": s.layers.model_dump(),
               "plan": s.tp.model_dump(mode="json")} for s in plan.stages]
    predicted = None if prediction is None else {
        "tokens_per_second": prediction.tokens_per_second,
        "decode_seconds_per_token": prediction.decode_seconds,
        "prefill_seconds": prediction.prefill_seconds,
        "prompt_tokens": prediction.prompt_tokens,
        "context_tokens": prediction.context_tokens,
    }
    return {"stages": stages, "plan": stages[0]["plan"] if len(stages) == 1 else None,
            "predicted": predicted}


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


def _prompt_tokens(node: Node, request: ChatCompletionRequest | CompletionRequest) -> list[int]:
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


def _generation(node: Node, request: ChatCompletionRequest | CompletionRequest,
                kind: str) -> GenerateRequest:
    if request.model != node.config.model:
        raise ApiError(404, f"The model '{request.model}' does not exist; this cluster serves "
                            f"'{node.config.model}'.", param="model", code="model_not_found")
    tokens = _prompt_tokens(node, request)
    context = node.spec.context_length
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


def _usage(done: Done) -> dict[str, int]:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens}


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
    if not node.is_leader():
        return await _pass_to_leader(request)
    body = await _read_json(request)
    parsed = _validate(ChatCompletionRequest if chat else CompletionRequest, body)
    generation = _generation(node, parsed, "chatcmpl" if chat else "cmpl")
    shape = _Shape(chat, generation.id, node.config.model)
    events = node.dispatcher.generate(generation)
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


_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "keep-alive", "host"}


async def _pass_to_leader(request: web.Request) -> web.StreamResponse:
    node = _node(request)
    leader = node.leader()
    if leader is None:
        raise ApiError(503, "cluster not ready: no leader", kind="server_error",
                       code="cluster_not_ready")
    body = await _read_json(request)  # malformed bodies are refused here already
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=3)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session, session.post(
            leader.api_url + request.path, json=body,
        ) as upstream:
            headers = {k: v for k, v in upstream.headers.items()
                       if k.lower() not in _HOP_HEADERS}
            response = web.StreamResponse(status=upstream.status, headers=headers)
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response
    except (aiohttp.ClientConnectionError, TimeoutError):
        raise ApiError(503, f"cluster not ready: leader {leader.node_id} unreachable",
                       kind="server_error", code="cluster_not_ready") from None
