"""Ollama's API (`/api/chat`, `/api/generate`, `/api/tags`, `/api/show`, `/api/ps`,
`/api/version`) over the same generation path as the OpenAI endpoints: the conversation through
the chat template, tool calls parsed by the model's mlx-lm tool parser, the same batching and
prompt cache; Ollama's response shapes, streamed as NDJSON (one JSON object a line)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any, Literal

from aiohttp import web

from exo_tp import __version__
from exo_tp.api.answer_stream import AnswerPiece, AnswerStream
from exo_tp.api.backend import Backend, collect, first_event
from exo_tp.api.chat_prompt import Prompt, choose_tools, completion_prompt, render_chat
from exo_tp.api.errors import ApiError
from exo_tp.api.generation_request import generate_request, sampling_params, token_budget
from exo_tp.api.http_io import off_loop, read_body, validate
from exo_tp.api.ollama_schema import ChatRequest, GenerateRequest, OllamaRequest, ShowRequest
from exo_tp.api.ollama_shapes import (
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
from exo_tp.api.openai_api import check_model
from exo_tp.wire.runtime import Delta, Done

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
    loaded = [c.id for c in node.models_view() if c.loaded]
    try:
        context: int | None = node.context_length
    except ApiError:  # this node has not prepared the model (yet)
        context = None
    running = [
        RunningModel(**_card(node, name).model_dump(), context_length=context) for name in loaded
    ]
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
    return web.json_response(reply.body())


# ---- generation ------------------------------------------------------------------------


def _chat_prompt(
    node: Backend, messages: list[dict[str, Any]], parsed: OllamaRequest, tools: Any
) -> Prompt:
    use = choose_tools(tools, None, node.tokenizer)
    args = {**node.defaults.chat_template_args, **parsed.template_args()}
    return render_chat(node.tokenizer, messages, use, args)


def _generate_prompt(node: Backend, parsed: GenerateRequest) -> Prompt:
    if parsed.raw:
        return Prompt(tokens=completion_prompt(node.tokenizer, parsed.prompt))
    return _chat_prompt(node, parsed.chat_messages(), parsed, None)


def _stats(done: Done, started: float) -> Statistics:
    """The last line's statistics."""
    prompt_ns = int(done.prompt_seconds * NS)
    return Statistics(
        done=True,
        done_reason=_finish(done),
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


class _Lines:
    """The answer's lines, chat or generate: each piece as a line, and the last with the
    statistics."""

    def __init__(self, model: str, chat: bool):
        self._model, self._chat = model, chat

    def line(
        self, piece: AnswerPiece, text: str, end: Statistics = NOT_DONE
    ) -> ChatLine | GenerateLine:
        """A line of ``piece`` (chat) or ``text`` (generate); ``end``'s statistics on the last."""
        head = {"model": self._model, "created_at": timestamp(), **end.model_dump()}
        if self._chat:
            return ChatLine(**head, message=_message(piece))
        return GenerateLine(**head, response=text)


def _loaded(node: Backend, chat: bool) -> web.Response:
    """An empty prompt or conversation only loads the model (Ollama's ``done_reason: load``)."""
    loaded = Statistics(done=True, done_reason="load")
    line = _Lines(node.model, chat).line(AnswerPiece(), "", loaded)
    return web.json_response(line.body())


async def chat(node: Backend, request: web.Request) -> web.StreamResponse:
    parsed = validate(ChatRequest, await read_body(request))
    check_model(node, parsed.served_name())
    if not parsed.messages:
        return _loaded(node, chat=True)
    prompt = await off_loop(_chat_prompt, node, parsed.chat_messages(), parsed, parsed.chat_tools())
    return await _answer(node, request, parsed, prompt, chat=True)


async def generate(node: Backend, request: web.Request) -> web.StreamResponse:
    parsed = validate(GenerateRequest, await read_body(request))
    check_model(node, parsed.served_name())
    if not parsed.prompt:
        return _loaded(node, chat=False)
    prompt = await off_loop(_generate_prompt, node, parsed)
    return await _answer(node, request, parsed, prompt, chat=False)


async def _answer(
    node: Backend, request: web.Request, parsed: OllamaRequest, prompt: Prompt, chat: bool
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
        node,
        "ollama",
        prompt.tokens,
        sampling,
        options.stop or [],
        "messages" if chat else "prompt",
        continuation=not chat,
    )
    answer = AnswerStream(node.tokenizer, prompt, streaming=False)
    lines = _Lines(node.model, chat)
    events = node.generate(generation)
    if parsed.stream:
        return await _stream(request, events, lines, answer, chat, started)
    deltas, done = await collect(events)
    whole = AnswerPiece()
    if chat:
        for delta in deltas:
            whole.add(answer.feed(delta.text))
        whole.add(answer.finish(_finish(done)))
    text = "".join(delta.text for delta in deltas)  # generate's: the tokens' text, unsplit
    return web.json_response(lines.line(whole, text, _stats(done, started)).body())


def _finish(done: Done) -> Literal["stop", "length"]:
    return "length" if done.finish_reason == "length" else "stop"


class _Ndjson:
    """An NDJSON response: one JSON object a line."""

    def __init__(self, request: web.Request):
        self._request = request
        self.response = web.StreamResponse(
            headers={"Content-Type": "application/x-ndjson", "Cache-Control": "no-cache"}
        )

    async def open(self) -> None:
        await self.response.prepare(self._request)

    async def send(self, line: ChatLine | GenerateLine | Error) -> None:
        await self.response.write((json.dumps(line.body()) + "\n").encode())

    async def close(self) -> web.StreamResponse:
        await self.response.write_eof()
        return self.response


async def _stream(
    request: web.Request,
    events: AsyncIterator[Delta | Done],
    lines: _Lines,
    answer: AnswerStream,
    chat: bool,
    started: float,
) -> web.StreamResponse:
    event = await first_event(events)
    out = _Ndjson(request)
    await out.open()
    try:
        while True:
            if isinstance(event, Delta):
                piece = answer.feed(event.text) if chat else AnswerPiece()
                if piece or (not chat and event.text):
                    await out.send(lines.line(piece, event.text))
            else:
                if chat and (piece := answer.finish(_finish(event))):
                    await out.send(lines.line(piece, ""))
                await out.send(lines.line(AnswerPiece(), "", _stats(event, started)))
                break
            event = await anext(events)
    except ApiError as error:  # mid-stream failure: an error line, then the stream ends
        await out.send(Error(error=error.message))
    finally:
        await events.aclose()
    return await out.close()
