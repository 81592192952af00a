"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) over the same
generation path as the OpenAI endpoints: the conversation through the chat template, tool uses
parsed by the model's mlx-lm tool parser, Anthropic's response and stream event shapes."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from aiohttp import web

from exo_tp.api.answer_stream import AnswerPiece, AnswerStream
from exo_tp.api.anthropic_schema import CountTokensRequest, MessagesRequest
from exo_tp.api.anthropic_shapes import (
    Block,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    Event,
    InputJsonDelta,
    Message,
    MessageDelta,
    MessageStart,
    MessageStop,
    OutputUsage,
    Ping,
    StopDelta,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    TokenCount,
    tool_use,
    usage,
)
from exo_tp.api.backend import Backend, collect, first_event
from exo_tp.api.chat_prompt import Prompt, choose_tools, render_chat
from exo_tp.api.errors import ApiError
from exo_tp.api.generation_request import generate_request, sampling_params, token_budget
from exo_tp.api.http_io import EventStream, json_view, off_loop, read_body, validate
from exo_tp.api.openai_api import check_model
from exo_tp.api.openai_schema import SamplingFields
from exo_tp.frozen import replace
from exo_tp.wire.runtime import Delta, Done


def _prompt(node: Backend, parsed: CountTokensRequest | MessagesRequest) -> Prompt:
    use = choose_tools(parsed.chat_tools(), parsed.chat_tool_choice(), node.tokenizer)
    return render_chat(
        node.tokenizer, parsed.chat_messages(), use, dict(node.defaults.chat_template_args)
    )


async def count_tokens(node: Backend, request: web.Request) -> web.Response:
    parsed = validate(CountTokensRequest, await read_body(request))
    check_model(node, parsed.model)
    prompt = await off_loop(_prompt, node, parsed)
    return json_view(TokenCount(input_tokens=len(prompt.tokens)))


def _stop_reason(done: Done, answer: AnswerStream) -> tuple[str, str | None]:
    """Anthropic's stop reason and stop sequence (an answer that called tools stopped to
    use them, whatever ended it after the call)."""
    if done.finish_reason == "length":
        return "max_tokens", None
    if answer.made_tool_call:
        return "tool_use", None
    if done.stop_string is not None:
        return "stop_sequence", done.stop_string
    return "end_turn", None


async def messages(node: Backend, request: web.Request) -> web.StreamResponse:
    parsed = validate(MessagesRequest, await read_body(request))
    check_model(node, parsed.model)
    prompt = await off_loop(_prompt, node, parsed)
    budget = token_budget(node, len(prompt.tokens), parsed.max_tokens, "messages", "max_tokens")
    fields = SamplingFields(temperature=parsed.temperature, top_p=parsed.top_p, top_k=parsed.top_k)
    sampling = sampling_params(node, fields, budget, logprobs=False, top_logprobs=0)
    generation = generate_request(
        node, "msg", prompt.tokens, sampling, parsed.stop_sequences or [], "messages"
    )
    single = bool(parsed.tool_choice and parsed.tool_choice.disable_parallel_tool_use)
    answer = AnswerStream(node.tokenizer, prompt, streaming=False, max_calls=1 if single else None)
    head = Message(
        id=f"msg_{uuid.uuid4().hex[:24]}",
        model=node.model,
        content=[],
        stop_reason=None,
        stop_sequence=None,
        usage=usage(len(prompt.tokens), None),
    )
    events = node.generate(generation)
    if parsed.stream:
        return await _stream(request, events, head, answer)
    deltas, done = await collect(events)
    whole = AnswerPiece()
    for delta in deltas:
        whole.add(answer.feed(delta.text))
    whole.add(answer.finish(_finish(done)))
    content: list[Block] = []
    if whole.reasoning:
        content.append(ThinkingBlock(thinking=whole.reasoning))
    if whole.content:
        content.append(TextBlock(text=whole.content))
    content += [tool_use(call) for call in whole.tool_calls]
    reason, sequence = _stop_reason(done, answer)
    return json_view(
        replace(
            head,
            content=content,
            stop_reason=reason,
            stop_sequence=sequence,
            usage=usage(len(prompt.tokens), done),
        )
    )


def _finish(done: Done) -> str:
    return "length" if done.finish_reason == "length" else "stop"


class _Blocks:
    """Content blocks of a streamed message: start, deltas, stop, one block at a time."""

    def __init__(self, stream: EventStream):
        self._stream = stream
        self._index = -1
        self._open: str | None = None

    async def send(self, event: Event) -> None:
        await self._stream.send(event, event=event.type)

    async def _start(self, block: Block) -> None:
        await self.close()
        self._index += 1
        self._open = block.type
        await self.send(ContentBlockStart(index=self._index, content_block=block))

    async def _delta(self, delta: ThinkingDelta | TextDelta | InputJsonDelta) -> None:
        await self.send(ContentBlockDelta(index=self._index, delta=delta))

    async def piece(self, piece: AnswerPiece) -> None:
        if piece.reasoning:
            if self._open != "thinking":
                await self._start(ThinkingBlock(thinking=""))
            await self._delta(ThinkingDelta(thinking=piece.reasoning))
        if piece.content:
            if self._open != "text":
                await self._start(TextBlock(text=""))
            await self._delta(TextDelta(text=piece.content))
        for call in piece.tool_calls:
            block = tool_use(call)
            arguments = json.dumps(block.input, ensure_ascii=False)
            await self._start(replace(block, input={}))
            await self._delta(InputJsonDelta(partial_json=arguments))
            await self.close()

    async def close(self) -> None:
        if self._open is not None:
            await self.send(ContentBlockStop(index=self._index))
            self._open = None


async def _stream(
    request: web.Request,
    events: AsyncIterator[Delta | Done],
    head: Message,
    answer: AnswerStream,
) -> web.StreamResponse:
    event = await first_event(events)
    stream = EventStream(request)
    await stream.open()
    blocks = _Blocks(stream)
    try:
        await blocks.send(MessageStart(message=head))
        await blocks.send(Ping())
        while True:
            if isinstance(event, Delta):
                await blocks.piece(answer.feed(event.text))
            else:
                await blocks.piece(answer.finish(_finish(event)))
                await blocks.close()
                reason, sequence = _stop_reason(event, answer)
                await blocks.send(
                    MessageDelta(
                        delta=StopDelta(stop_reason=reason, stop_sequence=sequence),
                        usage=OutputUsage(output_tokens=event.completion_tokens),
                    )
                )
                await blocks.send(MessageStop())
                break
            event = await anext(events)
    except ApiError as error:  # mid-stream failure: an error event, then the stream ends
        await stream.send(error.anthropic_body(), event="error")
    finally:
        await events.aclose()
    return await stream.close()
