"""OpenAI's chat completions and completions, whole or streamed, on the node that runs
generation (other nodes pass these requests through to it: see routes.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from exo_tp.api.answer_stream import AnswerPiece, AnswerStream
from exo_tp.api.backend import Backend, collect, first_event
from exo_tp.api.chat_prompt import Prompt, choose_tools, completion_prompt, render_chat
from exo_tp.api.errors import ApiError
from exo_tp.api.generation_request import (
    generate_request,
    sampling_params,
    token_budget,
)
from exo_tp.api.http_io import EventStream, json_view, off_loop, read_body, validate
from exo_tp.api.openai_schema import (
    ChatCompletionRequest,
    CompletionRequest,
    refuse_unsupported,
    without_harmless,
)
from exo_tp.api.openai_shapes import (
    ChatLogprobs,
    ChatShape,
    CompletionLogprobs,
    CompletionShape,
    finish_reason,
)
from exo_tp.api.token_text import TokenText
from exo_tp.frozen import replace
from exo_tp.wire.runtime import Delta, Done, TokenLogprob

DEFAULT_MODEL_ALIAS = "default_model"  # mlx_lm.server's name for the model it serves


def check_model(node: Backend, model: str | None) -> None:
    """404 for a model no node has; 503 while the leader loads another listed one."""
    if model is not None and model != DEFAULT_MODEL_ALIAS:
        node.require_model(model)


async def _parsed(request: web.Request, schema: type[Any]) -> Any:
    body = await read_body(request)
    if isinstance(body, dict):
        refuse_unsupported(body)
        body = without_harmless(body)  # e.g. "modalities": ["text"], "functions": []
    return validate(schema, body)


# ---- chat ---------------------------------------------------------------------------------


def _chat_prompt(node: Backend, parsed: ChatCompletionRequest) -> Prompt:
    tools = [t.model_dump(exclude_unset=True) for t in parsed.tools] if parsed.tools else None
    choice = parsed.tool_choice
    use = choose_tools(
        tools, choice if isinstance(choice, str | None) else choice.model_dump(), node.tokenizer
    )
    args = {**node.defaults.chat_template_args, **(parsed.chat_template_kwargs or {})}
    messages = [m.for_template() for m in parsed.messages]
    return render_chat(node.tokenizer, messages, use, args, parsed.role_mapping)


async def chat_completions(node: Backend, request: web.Request) -> web.StreamResponse:
    parsed: ChatCompletionRequest = await _parsed(request, ChatCompletionRequest)
    check_model(node, parsed.model)
    if parsed.top_logprobs and not parsed.logprobs:
        parsed = replace(parsed, logprobs=True)  # mlx_lm.server reads either
    prompt = await off_loop(_chat_prompt, node, parsed)
    budget = token_budget(
        node,
        len(prompt.tokens),
        parsed.requested_max_tokens(),
        "messages",
        "max_completion_tokens" if parsed.max_completion_tokens else "max_tokens",
    )
    sampling = sampling_params(node, parsed, budget, parsed.logprobs, parsed.top_logprobs or 0)
    generation = generate_request(
        node, "chatcmpl", prompt.tokens, sampling, parsed.stop_list(), "messages"
    )
    answer = AnswerStream(
        node.tokenizer,
        prompt,
        parsed.stream,
        max_calls=1 if parsed.parallel_tool_calls is False else None,
    )
    shape = ChatShape(generation.id, node.model)
    scores = ChatLogprobs(TokenText(node.tokenizer)) if parsed.logprobs else None
    events = node.generate(generation)
    if parsed.stream:
        return await _stream_chat(request, events, shape, answer, scores, parsed.include_usage())
    deltas, done = await collect(events)
    whole = AnswerPiece()
    for delta in deltas:
        whole.add(answer.feed(delta.text))
    reason = finish_reason(done)
    whole.add(answer.finish(reason))
    logprobs = scores.block(_logprobs(deltas)) if scores else None
    return json_view(shape.whole(whole, answer.finish_reason(reason), done, logprobs))


def _logprobs(deltas: list[Delta]) -> tuple[TokenLogprob, ...]:
    return tuple(scored for delta in deltas for scored in delta.logprobs)


async def _stream_chat(
    request: web.Request,
    events: AsyncIterator[Delta | Done],
    shape: ChatShape,
    answer: AnswerStream,
    scores: ChatLogprobs | None,
    include_usage: bool,
) -> web.StreamResponse:
    event = await first_event(events)
    stream = EventStream(request)
    await stream.open()
    try:
        await stream.send(shape.chunk(None, None, first=True))
        while True:
            if isinstance(event, Delta):
                piece = answer.feed(event.text)
                logprobs = scores.block(event.logprobs) if scores and event.logprobs else None
                if piece or logprobs:
                    await stream.send(shape.chunk(piece, None, logprobs))
            else:
                reason = finish_reason(event)
                piece = answer.finish(reason)
                if piece:
                    await stream.send(shape.chunk(piece, None))
                await stream.send(shape.chunk(None, answer.finish_reason(reason)))
                if include_usage:
                    await stream.send(shape.usage_chunk(event))
                await stream.send("[DONE]")
                break
            event = await anext(events)
    except ApiError as error:  # mid-stream failure: an error event, then the stream ends
        await stream.send(error.body())
    finally:
        await events.aclose()
    return await stream.close()


# ---- plain completions --------------------------------------------------------------------


def _echo(node: Backend, parsed: CompletionRequest, tokens: tuple[int, ...]) -> str:
    """The prompt as text, for ``echo`` (ids decoded once they are known to be the model's)."""
    value = parsed.prompt_value()
    return value if isinstance(value, str) else node.tokenizer.decode(list(tokens))


async def completions(node: Backend, request: web.Request) -> web.StreamResponse:
    parsed: CompletionRequest = await _parsed(request, CompletionRequest)
    check_model(node, parsed.model)
    if parsed.echo and parsed.wants_logprobs():
        raise ApiError(
            400,
            "Unsupported value for 'echo': the prompt's log-probabilities are "
            "not computed, so echo cannot go with logprobs.",
            param="echo",
        )
    tokens = await off_loop(completion_prompt, node.tokenizer, parsed.prompt_value())
    budget = token_budget(node, len(tokens), parsed.requested_max_tokens(), "prompt", "max_tokens")
    top = parsed.top_n()
    sampling = sampling_params(node, parsed, budget, parsed.wants_logprobs(), top)
    generation = generate_request(
        node, "cmpl", tokens, sampling, parsed.stop_list(), "prompt", continuation=True
    )
    shape = CompletionShape(generation.id, node.model)
    echo = await off_loop(_echo, node, parsed, generation.tokens) if parsed.echo else ""
    scores = CompletionLogprobs(TokenText(node.tokenizer), top) if parsed.wants_logprobs() else None
    events = node.generate(generation)
    if parsed.stream:
        return await _stream_completion(
            request, events, shape, echo, scores, parsed.include_usage()
        )
    deltas, done = await collect(events)
    text = echo + "".join(delta.text for delta in deltas)
    logprobs = scores.block(_logprobs(deltas)) if scores else None
    return json_view(shape.whole(text, finish_reason(done), done, logprobs))


async def _stream_completion(
    request: web.Request,
    events: AsyncIterator[Delta | Done],
    shape: CompletionShape,
    echo: str,
    scores: CompletionLogprobs | None,
    include_usage: bool,
) -> web.StreamResponse:
    event = await first_event(events)
    stream = EventStream(request)
    await stream.open()
    try:
        if echo:
            await stream.send(shape.chunk(echo, None))
        while True:
            if isinstance(event, Delta):
                logprobs = scores.block(event.logprobs) if scores and event.logprobs else None
                if event.text or logprobs:
                    await stream.send(shape.chunk(event.text, None, logprobs))
            else:
                await stream.send(shape.chunk("", finish_reason(event)))
                if include_usage:
                    await stream.send(shape.usage_chunk(event))
                await stream.send("[DONE]")
                break
            event = await anext(events)
    except ApiError as error:
        await stream.send(error.body())
    finally:
        await events.aclose()
    return await stream.close()
