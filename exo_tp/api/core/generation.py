"""The one generation path of every dialect: an `Ask` fitted to the model, its events read
as answer pieces, and those streamed or collected into a whole answer. Each dialect's
`Renderer` only shapes them (SSE events, NDJSON lines, JSON answers)."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Literal, Protocol

from aiohttp import web

from exo_tp.api.backend import Backend
from exo_tp.api.core.answer_stream import AnswerPiece, AnswerStream, PlainText
from exo_tp.api.core.errors import ApiError, api_path
from exo_tp.api.core.generation_request import Ask, fitted
from exo_tp.api.core.refusals import client_of
from exo_tp.api.core.structured import check, decoding_failure
from exo_tp.api.core.thinking_budget import within_budget
from exo_tp.api.http_io import EventStream, off_loop
from exo_tp.wire.runtime import Delta, Done, GenerateRequest, TokenLogprob

log = logging.getLogger(__name__)


def finish(done: Done) -> Literal["stop", "length"]:
    """Why the text ended, as every dialect reads it (a cancelled answer stopped)."""
    return "length" if done.finish_reason == "length" else "stop"


@dataclass(frozen=True)
class WholeAnswer:
    """An answer that was not streamed: its pieces in the order a stream would have sent
    them, the deltas they came from (for their log-probabilities), and its end. ``reason``
    is OpenAI's finish reason: "stop", "length", or "tool_calls" after a tool call."""

    pieces: list[AnswerPiece]
    deltas: list[Delta]
    done: Done
    reason: str

    def merged(self) -> AnswerPiece:
        whole = AnswerPiece()
        for piece in self.pieces:
            whole.add(piece)
        return whole

    def logprobs(self) -> tuple[TokenLogprob, ...]:
        return tuple(scored for delta in self.deltas for scored in delta.logprobs)


class Output(Protocol):
    """A streamed response (SSE or NDJSON): prepared once the first event is in, ended last."""

    response: web.StreamResponse

    async def open(self) -> None: ...

    async def close(self) -> web.StreamResponse: ...


class Renderer(Protocol):
    """One dialect's shapes of one answer. Streamed: ``output`` (which the other calls write
    to), ``start``, ``delta`` per event, then ``end``, or ``error`` when the generation fails
    midway (the stream is open by then: an error event rather than an HTTP status). Not
    streamed: ``whole`` only. ``reason`` is OpenAI's finish reason (see `WholeAnswer`)."""

    def output(self, request: web.Request) -> Output: ...

    async def start(self) -> None: ...

    async def delta(self, piece: AnswerPiece, delta: Delta) -> None: ...

    async def end(self, piece: AnswerPiece, done: Done, reason: str) -> None: ...

    async def error(self, error: ApiError) -> None: ...

    async def whole(self, answer: WholeAnswer) -> web.StreamResponse: ...


class SseRenderer:
    """The part of a renderer that streams server-sent events (`EventStream`)."""

    _out: EventStream  # set by output, before any other call writes to it

    def output(self, request: web.Request) -> EventStream:
        self._out = EventStream(request)
        return self._out

    def attach(self, out: EventStream) -> None:
        """Write to another renderer's stream (n choices share one)."""
        self._out = out


async def respond(
    node: Backend, request: web.Request, ask: Ask, renderer: Renderer
) -> web.StreamResponse:
    """Generate ``ask`` and answer it in ``renderer``'s shapes, streamed or whole."""
    generation = await prepared(node, ask)
    text = answer_text(node, ask)
    events = (
        node.generate(generation)
        if ask.thinking_budget is None
        else within_budget(
            node, generation, ask.thinking_budget, ask.prompt.initial_state == "reasoning"
        )
    )
    if generation.constraint is not None:
        events = _schema_named(events, ask.structure()[1])
    if ask.stream:
        return await _stream(request, events, text, renderer)
    deltas, done = await collect(events)
    return await renderer.whole(whole_answer(deltas, done, text))


async def prepared(node: Backend, ask: Ask) -> GenerateRequest:
    """The runtime's request for ``ask``; a schema that cannot compile is a 400 before any
    work (compiled off the loop: llguidance reads the tokenizer once, ~1 s)."""
    constraint, param = ask.structure()
    if constraint is not None:
        await off_loop(check, node.tokenizer, node.vocab_size, constraint, param)
    return fitted(node, ask)


async def _schema_named(
    events: AsyncGenerator[Delta | Done, None], param: str
) -> AsyncGenerator[Delta | Done, None]:
    """``events``, a grammar's failure while decoding an error naming ``param``."""
    try:
        async for event in events:
            yield event
    except ApiError as error:
        raise decoding_failure(error, param) from None
    finally:
        await events.aclose()


def answer_text(node: Backend, ask: Ask) -> AnswerStream | PlainText:
    """How the answer's text is read: split as a chat answer, or all of it content."""
    if ask.split:
        return AnswerStream(node.tokenizer, ask.prompt, ask.call_indexes, ask.max_calls)
    return PlainText()


def whole_answer(deltas: list[Delta], done: Done, text: AnswerStream | PlainText) -> WholeAnswer:
    pieces = [text.feed(delta.text) for delta in deltas]
    pieces.append(text.finish(finish(done)))
    return WholeAnswer(pieces, deltas, done, text.finish_reason(finish(done)))


async def _stream(
    request: web.Request,
    events: AsyncGenerator[Delta | Done, None],
    text: AnswerStream | PlainText,
    renderer: Renderer,
) -> web.StreamResponse:
    event = await first_event(events)
    out = renderer.output(request)
    try:
        await out.open()
        try:
            await play(event, events, text, renderer)
        except ApiError as error:  # mid-stream failure: an error event, then the stream ends
            await renderer.error(error)
        finally:
            await events.aclose()  # a client that left cancels its generation here
        return await out.close()
    except ConnectionResetError:  # the client (or the member passing it on) left: news, no bug
        return client_left(request, out.response)


def client_left(request: web.Request, response: web.StreamResponse) -> web.StreamResponse:
    """One line for a client that left its stream (or a member passing it on that dropped its
    connection): news, not a bug, so no traceback; the stream is over."""
    log.info(
        "client %s left %s before its answer ended", client_of(request), api_path(request.path)
    )
    return response


async def play(
    event: Delta | Done,
    events: AsyncGenerator[Delta | Done, None],
    text: AnswerStream | PlainText,
    renderer: Renderer,
) -> Done:
    """One answer's stream from its first event on, rendered; its end."""
    await renderer.start()
    while isinstance(event, Delta):
        await renderer.delta(text.feed(event.text), event)
        event = await _next(events)
    await renderer.end(text.finish(finish(event)), event, text.finish_reason(finish(event)))
    return event


async def first_event(events: AsyncGenerator[Delta | Done, None]) -> Delta | Done:
    """The first event, awaited before a stream opens: a failure before it (queue full,
    cluster not ready) is still a plain JSON error rather than a broken stream."""
    return await _next(events)


async def _next(events: AsyncGenerator[Delta | Done, None]) -> Delta | Done:
    """The next event; a grammar's failure while decoding is the schema's error."""
    try:
        return await anext(events)
    except ApiError as error:
        raise decoding_failure(error) from None


async def collect(
    events: AsyncGenerator[Delta | Done, None], first: Delta | None = None
) -> tuple[list[Delta], Done]:
    """A whole answer (for a request that is not streamed): its deltas (after ``first``, when
    it was read already) and its end."""
    deltas: list[Delta] = [] if first is None else [first]
    try:
        async for event in events:
            if isinstance(event, Delta):
                deltas.append(event)
            else:
                return deltas, event
    except ApiError as error:
        raise decoding_failure(error) from None
    finally:
        await events.aclose()
    raise RuntimeError("the generation ended without a Done event")  # Backend.generate ends so
