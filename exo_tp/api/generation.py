"""The one generation path of every dialect: an `Ask` fitted to the model, its events read
as answer pieces, and those streamed or collected into a whole answer. Each dialect's
`Renderer` only shapes them (SSE events, NDJSON lines, JSON answers)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal, Protocol

from aiohttp import web

from exo_tp.api.answer_stream import AnswerPiece, AnswerStream, PlainText
from exo_tp.api.backend import Backend
from exo_tp.api.errors import ApiError
from exo_tp.api.generation_request import Ask, fitted
from exo_tp.api.http_io import EventStream
from exo_tp.api.thinking_budget import within_budget
from exo_tp.wire.runtime import Delta, Done, TokenLogprob


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


async def respond(
    node: Backend, request: web.Request, ask: Ask, renderer: Renderer
) -> web.StreamResponse:
    """Generate ``ask`` and answer it in ``renderer``'s shapes, streamed or whole."""
    generation = fitted(node, ask)
    text = (
        AnswerStream(node.tokenizer, ask.prompt, ask.call_indexes, ask.max_calls)
        if ask.split
        else PlainText()
    )
    events = (
        node.generate(generation)
        if ask.thinking_budget is None
        else within_budget(
            node, generation, ask.thinking_budget, ask.prompt.initial_state == "reasoning"
        )
    )
    if ask.stream:
        return await _stream(request, events, text, renderer)
    deltas, done = await collect(events)
    pieces = [text.feed(delta.text) for delta in deltas]
    pieces.append(text.finish(finish(done)))
    return await renderer.whole(WholeAnswer(pieces, deltas, done, text.finish_reason(finish(done))))


async def _stream(
    request: web.Request,
    events: AsyncIterator[Delta | Done],
    text: AnswerStream | PlainText,
    renderer: Renderer,
) -> web.StreamResponse:
    event = await first_event(events)
    out = renderer.output(request)
    await out.open()
    try:
        await renderer.start()
        while isinstance(event, Delta):
            await renderer.delta(text.feed(event.text), event)
            event = await anext(events)
        piece = text.finish(finish(event))
        await renderer.end(piece, event, text.finish_reason(finish(event)))
    except ApiError as error:  # mid-stream failure: an error event, then the stream ends
        await renderer.error(error)
    finally:
        await events.aclose()
    return await out.close()


async def first_event(events: AsyncIterator[Delta | Done]) -> Delta | Done:
    """The first event, awaited before a stream opens: a failure before it (queue full,
    cluster not ready) is still a plain JSON error rather than a broken stream."""
    return await anext(events)


async def collect(events: AsyncIterator[Delta | Done]) -> tuple[list[Delta], Done]:
    """A whole answer (for a request that is not streamed): its deltas and its end."""
    deltas: list[Delta] = []
    try:
        async for event in events:
            if isinstance(event, Delta):
                deltas.append(event)
            else:
                return deltas, event
    finally:
        await events.aclose()
    raise RuntimeError("the generation ended without a Done event")  # Backend.generate ends so
