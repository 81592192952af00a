"""OpenAI's ``n``: n choices of one request, each its own generation (its own stream in the
batch). The first runs alone until its first token, and asks the ranks to keep its prompt's
KV cache in the prompt cache once prefilled (``keep_prompt``); the others join then and skip
that prefill. With a ``seed``, choice i samples with seed + i (mod 2**64), so that choices
differ yet repeat."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, Sequence
from typing import Protocol

from aiohttp import web

from exo_tp.api.backend import Backend
from exo_tp.api.core.errors import ApiError
from exo_tp.api.core.generation import (
    Renderer,
    WholeAnswer,
    answer_text,
    client_left,
    collect,
    first_event,
    play,
    prepared,
    whole_answer,
)
from exo_tp.api.core.generation_request import Ask
from exo_tp.api.http_io import EventStream
from exo_tp.frozen import replace
from exo_tp.wire.ids import RequestId
from exo_tp.wire.runtime import Delta, Done

SEEDS = 2**64  # mx.random.seed takes a uint64 (the API accepts int64 too)

Events = AsyncGenerator[Delta | Done, None]


class ChoiceRenderer(Renderer, Protocol):
    """A renderer of one choice whose stream is shared with the other choices'."""

    def output(self, request: web.Request) -> EventStream: ...

    def attach(self, out: EventStream) -> None: ...


class Choices(Protocol):
    """What belongs to all choices together: the stream's end once every choice ended
    (usage, ``[DONE]``), or the whole answer with every choice."""

    async def end(self, dones: list[Done]) -> None: ...

    async def whole(self, answers: list[WholeAnswer]) -> web.StreamResponse: ...


def choice_asks(ask: Ask, n: int) -> list[Ask]:
    """``ask`` as n choices: choice 0 keeps its id, choice i is id-i; seeds seed + i."""
    asks = []
    for i in range(n):
        sampling = ask.sampling
        if i and sampling.seed is not None:
            sampling = replace(sampling, seed=(sampling.seed + i) % SEEDS)
        one = RequestId(f"{ask.id}-{i}") if i else ask.id
        asks.append(dataclasses.replace(ask, id=one, sampling=sampling))
    return asks


def summed(dones: list[Done]) -> Done:
    """Usage as OpenAI counts it for n choices: the prompt once, every choice's tokens."""
    return replace(dones[0], completion_tokens=sum(d.completion_tokens for d in dones))


async def _rest(first: Delta | Done, events: Events) -> tuple[list[Delta], Done]:
    return ([], first) if isinstance(first, Done) else await collect(events, first)


async def respond_choices(
    node: Backend,
    request: web.Request,
    asks: Sequence[Ask],
    renderers: Sequence[ChoiceRenderer],
    choices: Choices,
) -> web.StreamResponse:
    """Generate every choice of ``asks`` and answer them together, streamed or whole."""
    generations = [await prepared(node, ask) for ask in asks]
    generations[0] = replace(generations[0], keep_prompt=True)
    streams: list[Events] = [node.generate(generations[0])]
    try:
        firsts = [await first_event(streams[0])]  # prefilled, and its cache kept
        streams += [node.generate(generation) for generation in generations[1:]]
        firsts += await asyncio.gather(*(first_event(events) for events in streams[1:]))
        texts = [answer_text(node, ask) for ask in asks]
        if not asks[0].stream:
            collected = await asyncio.gather(
                *(_rest(first, events) for first, events in zip(firsts, streams, strict=True))
            )
            return await choices.whole(
                [
                    whole_answer(deltas, done, text)
                    for (deltas, done), text in zip(collected, texts, strict=True)
                ]
            )
        out = renderers[0].output(request)
        for renderer in renderers[1:]:
            renderer.attach(out)
        try:
            await out.open()
            try:
                plays = zip(firsts, streams, texts, renderers, strict=True)
                dones = await asyncio.gather(*(play(*one) for one in plays))
                await choices.end(list(dones))
            except ApiError as error:  # mid-stream failure: an error event, then the end
                await renderers[0].error(error)
            return await out.close()
        except ConnectionResetError:  # the client left
            return client_left(request, out.response)
    finally:
        for events in streams:
            await events.aclose()
