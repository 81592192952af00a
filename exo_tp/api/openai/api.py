"""OpenAI's chat completions and completions, whole or streamed, on the node that runs
generation (other nodes pass these requests through to it: see routes.py): each request as an
`Ask` for the one generation path, and its answer in OpenAI's chunks and objects."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, Protocol, TypeVar

from aiohttp import web

from exo_tp.api.backend import Backend
from exo_tp.api.core.answer_stream import AnswerPiece
from exo_tp.api.core.chat_prompt import Prompt, completion_prompt, served_chat_prompt
from exo_tp.api.core.choices import choice_asks, respond_choices, summed
from exo_tp.api.core.errors import ApiError
from exo_tp.api.core.generation import SseRenderer, WholeAnswer, respond
from exo_tp.api.core.generation_request import Ask, check_model, request_id
from exo_tp.api.core.structured import response_format
from exo_tp.api.core.token_text import TokenText
from exo_tp.api.http_io import json_view, off_loop, read_body, validate
from exo_tp.api.openai.schema import ChatCompletionRequest, CompletionRequest
from exo_tp.api.openai.shapes import (
    ChatCompletion,
    ChatLogprobs,
    ChatShape,
    Completion,
    CompletionLogprobs,
    CompletionLogprobsBlock,
    CompletionShape,
    joined,
    usage,
)
from exo_tp.api.openai.unsupported import refuse_unsupported, without_harmless
from exo_tp.frozen import replace
from exo_tp.wire.ids import RequestId
from exo_tp.wire.runtime import Constraint, Delta, Done


async def _parsed(request: web.Request, schema: type[Any]) -> Any:
    body = await read_body(request)
    if isinstance(body, dict):
        refuse_unsupported(body)
        body = without_harmless(body)  # e.g. "modalities": ["text"], "functions": []
    return validate(schema, body)


class _OpenAIStream(SseRenderer):
    """What both answers stream alike: an error as OpenAI's error body, and the end's usage
    chunk (when asked for) and ``[DONE]``: after its own end, or with n choices after every
    choice's (``closes`` False: `_Choices` closes)."""

    _shape: ChatShape | CompletionShape

    def __init__(self, include_usage: bool, closes: bool):
        self._include_usage, self._closes = include_usage, closes

    async def _ended(self, done: Done) -> None:
        if self._closes:
            await self.close_stream(done)

    async def close_stream(self, done: Done) -> None:
        if self._include_usage:
            await self._out.send(self._shape.usage_chunk(done))
        await self._out.send("[DONE]")

    async def error(self, error: ApiError) -> None:
        await self._out.send(error.body())


# ---- chat ---------------------------------------------------------------------------------


def _response_format(parsed: ChatCompletionRequest) -> Constraint | None:
    form = parsed.response_format
    if form is None:
        return None
    schema = form.json_schema.schema_ if form.json_schema else None
    return response_format(form.type, schema, "response_format.json_schema.schema")


class _Chat(_OpenAIStream):
    """A chat completion (or its choice ``index`` of the answer ``answer_id``): whole, or as
    chunks (the first names the role)."""

    _shape: ChatShape

    def __init__(
        self, node: Backend, ask: Ask, include_usage: bool, index: int = 0, answer_id: str = ""
    ):
        super().__init__(include_usage, closes=not answer_id)
        self._shape = ChatShape(answer_id or ask.id, node.model, index)
        self._scores = ChatLogprobs(TokenText(node.tokenizer)) if ask.logprobs else None

    async def start(self) -> None:
        await self._out.send(self._shape.chunk(None, None, first=True))

    async def delta(self, piece: AnswerPiece, delta: Delta) -> None:
        scores = self._scores
        logprobs = scores.block(delta.logprobs) if scores and delta.logprobs else None
        if piece or logprobs:
            await self._out.send(self._shape.chunk(piece, None, logprobs))

    async def end(self, piece: AnswerPiece, done: Done, reason: str) -> None:
        if piece:
            await self._out.send(self._shape.chunk(piece, None))
        await self._out.send(self._shape.chunk(None, reason))
        await self._ended(done)

    async def view(self, answer: WholeAnswer) -> ChatCompletion:
        logprobs = self._scores.block(answer.logprobs()) if self._scores else None
        return self._shape.whole(answer.merged(), answer.reason, answer.done, logprobs)

    async def whole(self, answer: WholeAnswer) -> web.StreamResponse:
        return json_view(await self.view(answer))


async def chat_completions(node: Backend, request: web.Request) -> web.StreamResponse:
    parsed: ChatCompletionRequest = await _parsed(request, ChatCompletionRequest)
    node = check_model(node, parsed.model)
    if parsed.top_logprobs and not parsed.logprobs:
        parsed = replace(parsed, logprobs=True)  # mlx_lm.server reads either
    ask = Ask(
        id=request_id("chatcmpl"),
        prompt=await off_loop(served_chat_prompt, node, parsed.chat()),
        sampling=parsed,
        max_tokens=parsed.requested_max_tokens(),
        stream=parsed.stream,
        stops=parsed.stop_list(),
        logprobs=parsed.logprobs,
        top_logprobs=parsed.top_logprobs or 0,
        num_draft_tokens=parsed.num_draft_tokens,
        max_calls=1 if parsed.parallel_tool_calls is False else None,
        call_indexes=parsed.stream,
        constraint=_response_format(parsed),
        constraint_param="response_format.json_schema.schema",
    )
    if parsed.n == 1:
        return await respond(node, request, ask, _Chat(node, ask, parsed.include_usage()))
    asks = choice_asks(ask, parsed.n)
    chats = [_Chat(node, a, parsed.include_usage(), i, ask.id) for i, a in enumerate(asks)]
    return await respond_choices(node, request, asks, chats, _Choices(chats))


View = TypeVar("View", ChatCompletion, Completion)
ViewOut = TypeVar("ViewOut", ChatCompletion, Completion, covariant=True)


class _Viewed(Protocol[ViewOut]):
    """A choice's renderer, as `_Choices` reads it: its whole answer, the stream's end."""

    async def view(self, answer: WholeAnswer) -> ViewOut: ...

    async def close_stream(self, done: Done) -> None: ...


class _Choices(Generic[View]):
    """n choices in one answer: every choice's, the usage summed (the prompt counted once);
    streamed, one usage chunk and ``[DONE]`` after every choice's end."""

    def __init__(self, renderers: Sequence[_Viewed[View]]):
        self._renderers: Sequence[_Viewed[View]] = renderers

    async def end(self, dones: list[Done]) -> None:
        await self._renderers[0].close_stream(summed(dones))

    async def whole(self, answers: list[WholeAnswer]) -> web.StreamResponse:
        views = [await r.view(a) for r, a in zip(self._renderers, answers, strict=True)]
        answer = views[0]
        answer.choices = [choice for view in views for choice in view.choices]
        answer.usage = usage(summed([a.done for a in answers]))
        return json_view(answer)


# ---- plain completions --------------------------------------------------------------------


class _Completion(_OpenAIStream):
    """A completion: its text as it came, after the prompt's when ``echo`` asks for it, and
    with ``echo`` and ``logprobs`` the prompt's tokens scored first (the first one has none)."""

    _shape: CompletionShape

    def __init__(
        self,
        node: Backend,
        ask: Ask,
        parsed: CompletionRequest,
        prompt: str | list[int],
        index: int = 0,
        answer_id: str = "",
    ):
        super().__init__(parsed.include_usage(), closes=not answer_id)
        self._node, self._parsed, self._tokens = node, parsed, ask.prompt.tokens
        self._prompt, self._scored = prompt, ask.prompt_logprobs is not None
        self._shape = CompletionShape(answer_id or ask.id, node.model, index)
        top = parsed.top_n()
        wanted = ask.logprobs or self._scored
        self._scores = CompletionLogprobs(TokenText(node.tokenizer), top) if wanted else None

    async def _echo(self) -> str:
        """The prompt as text, for ``echo`` (ids decoded once they are known to be the
        model's: the generation was fitted before anything is rendered)."""
        if not self._parsed.echo:
            return ""
        if isinstance(self._prompt, str):
            return self._prompt
        return await off_loop(self._node.tokenizer.decode, self._tokens)

    def _prompt_block(self, delta: Delta) -> CompletionLogprobsBlock | None:
        if self._scores is None or not self._parsed.wants_logprobs():
            return None
        return self._scores.prompt_block(self._tokens[0], delta.prompt_logprobs)

    async def start(self) -> None:
        if not self._scored and (echo := await self._echo()):
            await self._out.send(self._shape.chunk(echo, None))

    async def delta(self, piece: AnswerPiece, delta: Delta) -> None:
        if self._scored and not delta.tokens:  # the prompt's scores, before any token
            prompt = self._prompt_block(delta)
            await self._out.send(self._shape.chunk(await self._echo(), None, prompt))
            return
        scores = self._scores
        logprobs = scores.block(delta.logprobs) if scores and delta.logprobs else None
        if piece or logprobs:
            await self._out.send(self._shape.chunk(piece.content, None, logprobs))

    async def end(self, piece: AnswerPiece, done: Done, reason: str) -> None:
        await self._out.send(self._shape.chunk("", reason))
        await self._ended(done)

    async def view(self, answer: WholeAnswer) -> Completion:
        text = await self._echo() + answer.merged().content
        blocks = []
        if self._scored:
            scored = next((d for d in answer.deltas if not d.tokens), None)
            blocks.append(self._prompt_block(scored) if scored else None)
        if self._scores is not None and self._parsed.wants_logprobs():
            blocks.append(self._scores.block(answer.logprobs()))
        return self._shape.whole(text, answer.reason, answer.done, joined(blocks))

    async def whole(self, answer: WholeAnswer) -> web.StreamResponse:
        return json_view(await self.view(answer))


class _Prompts(_Choices[Completion]):
    """Choices of several prompts: usage counts every prompt once, every choice's tokens."""

    def __init__(self, renderers: Sequence[_Completion], per_prompt: int):
        super().__init__(renderers)
        self._per_prompt = per_prompt

    def _summed(self, dones: list[Done]) -> Done:
        firsts = dones[:: self._per_prompt]
        prompts = sum(d.prompt_tokens for d in firsts)
        return replace(summed(dones), prompt_tokens=prompts)

    async def end(self, dones: list[Done]) -> None:
        await self._renderers[0].close_stream(self._summed(dones))

    async def whole(self, answers: list[WholeAnswer]) -> web.StreamResponse:
        views = [await r.view(a) for r, a in zip(self._renderers, answers, strict=True)]
        answer = views[0]
        answer.choices = [choice for view in views for choice in view.choices]
        answer.usage = usage(self._summed([a.done for a in answers]))
        return json_view(answer)


async def completions(node: Backend, request: web.Request) -> web.StreamResponse:
    parsed: CompletionRequest = await _parsed(request, CompletionRequest)
    node = check_model(node, parsed.model)
    prompts = parsed.prompt_values()
    answer_id = request_id("cmpl")
    asks: list[Ask] = []
    for value in prompts:
        tokens = await off_loop(completion_prompt, node.tokenizer, value)
        ask = Ask(
            id=RequestId(f"{answer_id}-p{len(asks)}") if asks else answer_id,
            prompt=Prompt(tokens=tokens),
            sampling=parsed,
            max_tokens=parsed.requested_max_tokens(),
            stream=parsed.stream,
            stops=parsed.stop_list(),
            prompt_param="prompt",
            logprobs=parsed.wants_logprobs(),
            top_logprobs=parsed.top_n(),
            continuation=True,
            num_draft_tokens=parsed.num_draft_tokens,
            split=False,
            prompt_logprobs=parsed.prompt_scores(),
        )
        asks += choice_asks(ask, parsed.n)
    if len(asks) == 1:
        return await respond(node, request, asks[0], _Completion(node, asks[0], parsed, prompts[0]))
    texts = [
        _Completion(node, a, parsed, prompts[i // parsed.n], i, answer_id)
        for i, a in enumerate(asks)
    ]
    return await respond_choices(node, request, asks, texts, _Prompts(texts, parsed.n))
