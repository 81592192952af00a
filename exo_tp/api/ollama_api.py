"""Ollama's API (`/api/chat`, `/api/generate`, `/api/tags`, `/api/show`, `/api/ps`,
`/api/version`) over the same generation path as the OpenAI endpoints: the conversation through
the chat template, tool calls parsed by the model's mlx-lm tool parser, the same batching and
prompt cache; Ollama's response shapes, streamed as NDJSON (one JSON object a line)."""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from exo_tp import __version__
from exo_tp.api.answer_stream import AnswerPiece, AnswerStream
from exo_tp.api.backend import Backend, collect, first_event
from exo_tp.api.chat_prompt import Prompt, choose_tools, completion_prompt, render_chat
from exo_tp.api.errors import ApiError
from exo_tp.api.generation_request import generate_request, sampling_params, token_budget
from exo_tp.api.http_io import off_loop, read_body, validate
from exo_tp.api.ollama_schema import ChatRequest, GenerateRequest, ShowRequest, _Request
from exo_tp.api.openai_api import check_model
from exo_tp.runtime.messages import Delta, Done

OLLAMA_PREFIX = "/api/"
# The Ollama version whose API this follows (clients check it for features such as tools).
OLLAMA_VERSION = "0.12.0"
NS = 1_000_000_000


def ollama_error(error: ApiError) -> web.Response:
    """Ollama's error body: ``{"error": "..."}``."""
    return web.json_response({"error": error.message}, status=error.status, headers=error.headers())


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")


def _since(unix: float) -> str:
    moment = datetime.datetime.fromtimestamp(unix, datetime.UTC)
    return moment.isoformat().replace("+00:00", "Z")


# ---- model views -----------------------------------------------------------------------


def _details() -> dict[str, Any]:
    return {
        "parent_model": "",
        "format": "safetensors",
        "family": "",
        "families": None,
        "parameter_size": "",
        "quantization_level": "",
    }


def _card(node: Backend, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "model": name,
        "modified_at": _since(node.started),
        "size": 0,  # the cluster holds shards; no one file has the model's size
        "digest": "",
        "details": _details(),
    }


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": OLLAMA_VERSION, "exo_tp": __version__})


def tags(node: Backend) -> web.Response:
    return web.json_response({"models": [_card(node, c["id"]) for c in node.models_view()]})


def ps(node: Backend) -> web.Response:
    loaded = [c["id"] for c in node.models_view() if c.get("loaded")]
    try:
        context: int | None = node.context_length
    except ApiError:  # this node has not prepared the model (yet)
        context = None
    never = "2318-01-01T00:00:00Z"  # the cluster keeps its model loaded until told otherwise
    return web.json_response(
        {
            "models": [
                {
                    **_card(node, name),
                    "expires_at": never,
                    "size_vram": 0,
                    "context_length": context,
                }
                for name in loaded
            ]
        }
    )


async def show(node: Backend, request: web.Request) -> web.Response:
    parsed = validate(ShowRequest, await read_body(request))
    wanted = parsed.wanted()
    if not wanted:
        raise ApiError(400, "Missing required parameter: 'model'.", param="model")
    cards = {c["id"]: c for c in node.models_view()}
    card = cards.get(wanted)
    if card is None:
        raise ApiError(404, f"model '{wanted[:200]}' not found", param="model")
    body: dict[str, Any] = {
        "modelfile": "",
        "parameters": "",
        "template": "",
        "details": _details(),
        "model_info": {},
        "capabilities": ["completion"],
        "modified_at": _since(node.started),
    }
    if card.get("loaded"):
        tokenizer = node.tokenizer
        body["template"] = getattr(tokenizer, "chat_template", None) or ""
        body["model_info"] = {"general.context_length": node.context_length}
        if tokenizer.has_tool_calling:
            body["capabilities"].append("tools")
        if tokenizer.has_thinking:
            body["capabilities"].append("thinking")
    return web.json_response(body)


# ---- generation ------------------------------------------------------------------------


def _chat_prompt(
    node: Backend, messages: list[dict[str, Any]], parsed: _Request, tools: Any
) -> Prompt:
    use = choose_tools(tools, None, node.tokenizer)
    args = {**node.defaults.chat_template_args, **parsed.template_args()}
    return render_chat(node.tokenizer, messages, use, args)


def _generate_prompt(node: Backend, parsed: GenerateRequest) -> Prompt:
    if parsed.raw:
        return Prompt(tokens=completion_prompt(node.tokenizer, parsed.prompt))
    return _chat_prompt(node, parsed.chat_messages(), parsed, None)


def _loaded(node: Backend, parsed: _Request, done: dict[str, Any]) -> web.Response:
    """An empty prompt or conversation only loads the model (Ollama's ``done_reason: load``)."""
    return web.json_response(
        {"model": node.model, "created_at": _now(), **done, "done": True, "done_reason": "load"}
    )


def _stats(done: Done, started: float) -> dict[str, Any]:
    prompt_ns = int(done.prompt_seconds * NS)
    return {
        "done": True,
        "done_reason": "length" if done.finish_reason == "length" else "stop",
        "total_duration": int((time.perf_counter() - started) * NS),
        "load_duration": 0,
        "prompt_eval_count": done.prompt_tokens,
        "prompt_eval_duration": prompt_ns,
        "eval_count": done.completion_tokens,
        "eval_duration": max(0, int(done.seconds * NS) - prompt_ns),
    }


def _tool_calls(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-shaped calls as Ollama's: arguments as an object."""
    return [
        {
            "function": {
                "name": call["function"]["name"],
                "arguments": json.loads(call["function"]["arguments"]),
            }
        }
        for call in calls
    ]


def _message(piece: AnswerPiece) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": piece.content}
    if piece.reasoning:
        message["thinking"] = piece.reasoning
    if piece.tool_calls:
        message["tool_calls"] = _tool_calls(piece.tool_calls)
    return message


async def chat(node: Backend, request: web.Request) -> web.StreamResponse:
    parsed = validate(ChatRequest, await read_body(request))
    check_model(node, parsed.served_name())
    if not parsed.messages:
        return _loaded(node, parsed, {"message": {"role": "assistant", "content": ""}})
    prompt = await off_loop(_chat_prompt, node, parsed.chat_messages(), parsed, parsed.chat_tools())
    return await _answer(node, request, parsed, prompt, chat=True)


async def generate(node: Backend, request: web.Request) -> web.StreamResponse:
    parsed = validate(GenerateRequest, await read_body(request))
    check_model(node, parsed.served_name())
    if not parsed.prompt:
        return _loaded(node, parsed, {"response": ""})
    prompt = await off_loop(_generate_prompt, node, parsed)
    return await _answer(node, request, parsed, prompt, chat=False)


async def _answer(
    node: Backend, request: web.Request, parsed: _Request, prompt: Prompt, chat: bool
) -> web.StreamResponse:
    started = time.perf_counter()
    options = parsed.opts()
    wanted = options.max_tokens(len(prompt.tokens), node.context_length)
    param = "messages" if chat else "prompt"
    budget = token_budget(node, len(prompt.tokens), wanted, param, "options.num_predict")
    sampling = sampling_params(
        node, options.sampling(node.context_length), budget, logprobs=False, top_logprobs=0
    )
    # generate's text continues its prompt: a first token's leading space is kept
    generation = generate_request(
        "ollama", prompt.tokens, sampling, options.stop or [], continuation=not chat
    )
    answer = AnswerStream(node.tokenizer, prompt, streaming=False)
    events = node.generate(generation)
    if parsed.stream:
        return await _stream(request, events, node.model, answer, chat, started)
    deltas, done = await collect(events)
    if chat:
        whole = AnswerPiece()
        for delta in deltas:
            whole.add(answer.feed(delta.text))
        whole.add(answer.finish(_finish(done)))
        body: dict[str, Any] = {"message": _message(whole)}
    else:  # generate's text is the tokens' text, unsplit
        body = {"response": "".join(delta.text for delta in deltas)}
    return web.json_response(
        {"model": node.model, "created_at": _now(), **body, **_stats(done, started)}
    )


def _finish(done: Done) -> str:
    return "length" if done.finish_reason == "length" else "stop"


class _Lines:
    """An NDJSON response: one JSON object a line."""

    def __init__(self, request: web.Request):
        self._request = request
        self.response = web.StreamResponse(
            headers={"Content-Type": "application/x-ndjson", "Cache-Control": "no-cache"}
        )

    async def open(self) -> None:
        await self.response.prepare(self._request)

    async def send(self, payload: dict[str, Any]) -> None:
        await self.response.write((json.dumps(payload) + "\n").encode())

    async def close(self) -> web.StreamResponse:
        await self.response.write_eof()
        return self.response


async def _stream(
    request: web.Request,
    events: AsyncIterator[Delta | Done],
    model: str,
    answer: AnswerStream,
    chat: bool,
    started: float,
) -> web.StreamResponse:
    event = await first_event(events)
    lines = _Lines(request)
    await lines.open()

    def line(piece: AnswerPiece | None, text: str) -> dict[str, Any]:
        head = {"model": model, "created_at": _now()}
        if chat:
            return {**head, "message": _message(piece or AnswerPiece())}
        return {**head, "response": text}

    try:
        while True:
            if isinstance(event, Delta):
                piece = answer.feed(event.text) if chat else None
                if piece or (not chat and event.text):
                    await lines.send({**line(piece, event.text), "done": False})
            else:
                if chat:
                    piece = answer.finish(_finish(event))
                    if piece:
                        await lines.send({**line(piece, ""), "done": False})
                await lines.send({**line(None, ""), **_stats(event, started)})
                break
            event = await anext(events)
    except ApiError as error:  # mid-stream failure: an error line, then the stream ends
        await lines.send({"error": error.message})
    finally:
        await events.aclose()
    return await lines.close()
