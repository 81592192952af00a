"""Ollama's API (`/api/chat`, `/api/generate`, `/api/tags`, `/api/show`, `/api/ps`,
`/api/version`) over the same generation path as the OpenAI endpoints: the conversation through
the chat template, tool calls parsed by the model's mlx-lm tool parser, the same batching and
prompt cache; Ollama's response shapes, streamed as NDJSON (one JSON object a line)."""

from __future__ import annotations

import json
import time
from typing import Any

from aiohttp import web

from exo_tp import __version__
from exo_tp.api.backend import Backend
from exo_tp.api.core.answer_stream import AnswerPiece
from exo_tp.api.core.chat_prompt import Prompt, completion_prompt, served_chat_prompt
from exo_tp.api.core.errors import ApiError
from exo_tp.api.core.generation import WholeAnswer, finish, respond
from exo_tp.api.core.generation_request import Ask, check_model, request_id
from exo_tp.api.core.structured import ANY_OBJECT, json_schema
from exo_tp.api.http_io import NdjsonStream, off_loop, read_body, validate
from exo_tp.api.ollama.schema import ChatRequest, GenerateRequest, OllamaRequest, ShowRequest
from exo_tp.api.ollama.shapes import (
    FOREVER,
    CallFunction,
    ChatLine,
    Error,
    GenerateLine,
    Message,
    ModelCard,
    Running,
    RunningModel,
    Show,
    Statistics,
    Tags,
    ToolCall,
    Version,
    timestamp,
)
from exo_tp.vision.families import NoImages
from exo_tp.wire.runtime import Constraint, Delta, Done

OLLAMA_PREFIX = "/api/"
# The Ollama version whose API this follows (clients check it for features such as tools).
OLLAMA_VERSION = "0.12.0"
NS = 1_000_000_000
NOT_DONE = Statistics(done=False)


def ollama_error(error: ApiError) -> web.Response:
    """Ollama's error body: ``{"error": "..."}``."""
    return web.json_response(
        Error(error=error.message).body(), status=error.status, headers=error.headers()
    )


# ---- model views -----------------------------------------------------------------------


def _card(node: Backend, name: str) -> ModelCard:
    return ModelCard(name=name, model=name, modified_at=timestamp(node.started))


async def version(request: web.Request) -> web.Response:
    return web.json_response(Version(version=OLLAMA_VERSION, exo_tp=__version__).body())


def tags(node: Backend) -> web.Response:
    return web.json_response(Tags(models=[_card(node, c.id) for c in node.models_view()]).body())


def ps(node: Backend) -> web.Response:
    running = []
    for card in node.models_view():
        if not card.loaded:
            continue
        context, expires = node.resident(card.id)
        until = FOREVER if expires is None else timestamp(time.time() + expires)
        running.append(
            RunningModel(
                **_card(node, card.id).model_dump(), context_length=context, expires_at=until
            )
        )
    return web.json_response(Running(models=running).body())


async def show(node: Backend, request: web.Request) -> web.Response:
    parsed = validate(ShowRequest, await read_body(request))
    wanted = parsed.wanted()
    if not wanted:
        raise ApiError(400, "Missing required parameter: 'model'.", param="model")
    card = next((c for c in node.models_view() if c.id == wanted), None)
    if card is None:
        raise ApiError(404, f"model '{wanted[:200]}' not found", param="model")
    reply = Show(capabilities=["completion"], modified_at=timestamp(node.started))
    if card.loaded:
        tokenizer = node.tokenizer
        template = getattr(tokenizer, "chat_template", None)
        reply.template = template if isinstance(template, str) else ""
        reply.model_info = {"general.context_length": node.context_length}
        if tokenizer.has_tool_calling:
            reply.capabilities.append("tools")
        if tokenizer.has_thinking:
            reply.capabilities.append("thinking")
        if node.images is not None and not isinstance(node.images, NoImages):
            reply.capabilities.append("vision")
    return web.json_response(reply.body())


# ---- generation ------------------------------------------------------------------------


def _generate_prompt(node: Backend, parsed: GenerateRequest) -> Prompt:
    if parsed.raw:
        return Prompt(tokens=completion_prompt(node.tokenizer, parsed.prompt))
    return served_chat_prompt(node, parsed.chat())


def _stats(done: Done, started: float) -> Statistics:
    """The last line's statistics."""
    prompt_ns = int(done.prompt_seconds * NS)
    return Statistics(
        done=True,
        done_reason=finish(done),
        total_duration=int((time.perf_counter() - started) * NS),
        load_duration=0,
        prompt_eval_count=done.prompt_tokens,
        prompt_eval_duration=prompt_ns,
        eval_count=done.completion_tokens,
        eval_duration=max(0, int(done.seconds * NS) - prompt_ns),
    )


def _message(piece: AnswerPiece) -> Message:
    """The piece as Ollama's message: tool-call arguments as an object."""
    calls = [
        ToolCall(
            function=CallFunction(
                name=call["function"]["name"], arguments=json.loads(call["function"]["arguments"])
            )
        )
        for call in piece.tool_calls
    ]
    return Message(
        content=piece.content, thinking=piece.reasoning or None, tool_calls=calls or None
    )


def _line(model: str, chat: bool, piece: AnswerPiece, end: Statistics) -> ChatLine | GenerateLine:
    """A line of the answer, chat (a message) or generate (its text); ``end``'s statistics on
    the last."""
    stats = end.model_dump()
    if chat:
        return ChatLine(model=model, created_at=timestamp(), message=_message(piece), **stats)
    return GenerateLine(model=model, created_at=timestamp(), response=piece.content, **stats)


def _loaded(node: Backend, chat: bool) -> web.Response:
    """An empty prompt or conversation only loads the model (Ollama's ``done_reason: load``)."""
    loaded = Statistics(done=True, done_reason="load")
    return web.json_response(_line(node.model, chat, AnswerPiece(), loaded).body())


def _unloaded(node: Backend, parsed: OllamaRequest, chat: bool) -> web.Response:
    done = Statistics(done=True, done_reason="unload")
    model = parsed.model or node.model
    return web.json_response(_line(model, chat, AnswerPiece(), done).body())


async def _keep_alive(
    node: Backend, parsed: OllamaRequest, empty: bool, chat: bool
) -> web.Response | None:
    """Ollama's ``keep_alive``: with nothing to answer and 0, unload the model now (its
    answer); else the model's served (loaded if need be) and kept that long once idle."""
    keep = parsed.keep_seconds()
    if empty and keep == 0:
        await node.unload_model(parsed.served_name() or "")
        return _unloaded(node, parsed, chat)
    node = check_model(node, parsed.served_name())
    if keep is not None:
        node.keep_alive(keep)
    return None


async def chat(node: Backend, request: web.Request) -> web.StreamResponse:
    parsed = validate(ChatRequest, await read_body(request))
    if (unloaded := await _keep_alive(node, parsed, not parsed.messages, chat=True)) is not None:
        return unloaded
    if not parsed.messages:
        return _loaded(node, chat=True)
    prompt = await off_loop(served_chat_prompt, node, parsed.chat())
    return await _answer(node, request, parsed, prompt, chat=True)


async def generate(node: Backend, request: web.Request) -> web.StreamResponse:
    parsed = validate(GenerateRequest, await read_body(request))
    if (unloaded := await _keep_alive(node, parsed, not parsed.prompt, chat=False)) is not None:
        return unloaded
    if not parsed.prompt:
        return _loaded(node, chat=False)
    prompt = await off_loop(_generate_prompt, node, parsed)
    return await _answer(node, request, parsed, prompt, chat=False)


async def _answer(
    node: Backend, request: web.Request, parsed: OllamaRequest, prompt: Prompt, chat: bool
) -> web.StreamResponse:
    lines = _Lines(node.model, chat)
    options = parsed.opts()
    ask = Ask(
        id=request_id("ollama"),
        prompt=prompt,
        sampling=options.sampling(node.context_length),
        max_tokens=options.max_tokens(len(prompt.tokens), node.context_length),
        stream=parsed.stream,
        stops=options.stop or [],
        prompt_param="messages" if chat else "prompt",
        # generate's text continues its prompt (a first token's leading space is kept), and
        # is sent as it came, unsplit
        continuation=not chat,
        split=chat,
        constraint=_format(parsed.format),
        constraint_param="format",
    )
    return await respond(node, request, ask, lines)


def _format(form: str | dict[str, Any] | None) -> Constraint | None:
    """Ollama's ``format``: "json" (any JSON object, as Ollama's JSON mode) or a schema."""
    if not form:
        return None
    return ANY_OBJECT if form == "json" else json_schema(form, "format")


class _Lines:
    """The answer's lines, chat or generate: each piece as a line, and the last with the
    statistics; not streamed, only that last one, with the whole answer."""

    _out: NdjsonStream  # set by output, before any other call writes to it

    def __init__(self, model: str, chat: bool):
        self._model, self._chat = model, chat
        self._started = time.perf_counter()

    def output(self, request: web.Request) -> NdjsonStream:
        self._out = NdjsonStream(request)
        return self._out

    async def start(self) -> None:
        pass  # Ollama's stream starts with the answer's first line

    async def _piece(self, piece: AnswerPiece) -> None:
        if piece:
            await self._out.send(_line(self._model, self._chat, piece, NOT_DONE))

    async def delta(self, piece: AnswerPiece, delta: Delta) -> None:
        await self._piece(piece)

    async def end(self, piece: AnswerPiece, done: Done, reason: str) -> None:
        await self._piece(piece)
        end = _stats(done, self._started)
        await self._out.send(_line(self._model, self._chat, AnswerPiece(), end))

    async def error(self, error: ApiError) -> None:
        await self._out.send(Error(error=error.message))

    async def whole(self, answer: WholeAnswer) -> web.StreamResponse:
        line = _line(self._model, self._chat, answer.merged(), _stats(answer.done, self._started))
        return web.json_response(line.body())
