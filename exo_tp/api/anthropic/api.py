"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) over the same
generation path as the OpenAI endpoints: the conversation through the chat template, tool uses
parsed by the model's mlx-lm tool parser, Anthropic's response and stream event shapes."""

from __future__ import annotations

import json
import uuid

from aiohttp import web

from exo_tp.api.anthropic.schema import CountTokensRequest, MessagesRequest
from exo_tp.api.anthropic.shapes import (
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
from exo_tp.api.backend import Backend
from exo_tp.api.core.answer_stream import AnswerPiece
from exo_tp.api.core.chat_prompt import Prompt, served_chat_prompt
from exo_tp.api.core.errors import ApiError
from exo_tp.api.core.generation import SseRenderer, WholeAnswer, respond
from exo_tp.api.core.generation_request import Ask, check_model, request_id
from exo_tp.api.core.left_out import leave_out
from exo_tp.api.core.sampling import SamplingFields
from exo_tp.api.http_io import json_view, off_loop, read_body, validate
from exo_tp.frozen import replace
from exo_tp.wire.runtime import Delta, Done


def _prompt(node: Backend, parsed: CountTokensRequest | MessagesRequest) -> Prompt:
    return served_chat_prompt(node, parsed.chat())


async def count_tokens(node: Backend, request: web.Request) -> web.Response:
    parsed = validate(CountTokensRequest, await read_body(request))
    node = check_model(node, parsed.model)
    prompt = await off_loop(_prompt, node, parsed)
    return json_view(TokenCount(input_tokens=len(prompt.tokens)))


def _stop_reason(done: Done, reason: str) -> tuple[str, str | None]:
    """Anthropic's stop reason and stop sequence, from OpenAI's finish ``reason`` (an answer
    that called tools stopped to use them, whatever ended it after the call)."""
    if reason == "length":
        return "max_tokens", None
    if reason == "tool_calls":
        return "tool_use", None
    if done.stop_string is not None:
        return "stop_sequence", done.stop_string
    return "end_turn", None


async def messages(node: Backend, request: web.Request) -> web.StreamResponse:
    parsed = validate(MessagesRequest, await read_body(request))
    node = check_model(node, parsed.model)
    leave_out(request, parsed.left_out())
    prompt = await off_loop(_prompt, node, parsed)
    single = bool(parsed.tool_choice and parsed.tool_choice.disable_parallel_tool_use)
    ask = Ask(
        id=request_id("msg"),
        prompt=prompt,
        sampling=SamplingFields(
            temperature=parsed.temperature, top_p=parsed.top_p, top_k=parsed.top_k
        ),
        max_tokens=parsed.max_tokens,
        stream=parsed.stream,
        stops=parsed.stop_sequences or [],
        max_calls=1 if single else None,
        thinking_budget=parsed.thinking_budget(),
    )
    head = Message(
        id=f"msg_{uuid.uuid4().hex[:24]}",
        model=node.model,
        content=[],
        stop_reason=None,
        stop_sequence=None,
        usage=usage(len(prompt.tokens), None),
    )
    renderer = _Messages(head, len(prompt.tokens), parsed.shows_thinking())
    return await respond(node, request, ask, renderer)


class _Messages(SseRenderer):
    """A message: whole, or streamed as content blocks (start, deltas, stop), one block at a
    time, between its start and its stop reason."""

    def __init__(self, head: Message, prompt_tokens: int, thinking: bool):
        self._head, self._prompt_tokens = head, prompt_tokens
        self._thinking = thinking  # False: thinking.display "omitted", no thinking text sent
        self._index = -1
        self._open: str | None = None

    async def _send(self, event: Event) -> None:
        await self._out.send(event, event=event.type)

    async def _start_block(self, block: Block) -> None:
        await self._close_block()
        self._index += 1
        self._open = block.type
        await self._send(ContentBlockStart(index=self._index, content_block=block))

    async def _block_delta(self, delta: ThinkingDelta | TextDelta | InputJsonDelta) -> None:
        await self._send(ContentBlockDelta(index=self._index, delta=delta))

    async def _close_block(self) -> None:
        if self._open is not None:
            await self._send(ContentBlockStop(index=self._index))
            self._open = None

    async def start(self) -> None:
        await self._send(MessageStart(message=self._head))
        await self._send(Ping())

    async def delta(self, piece: AnswerPiece, delta: Delta) -> None:
        await self._blocks(piece)

    async def _blocks(self, piece: AnswerPiece) -> None:
        if piece.reasoning and self._thinking:
            if self._open != "thinking":
                await self._start_block(ThinkingBlock(thinking=""))
            await self._block_delta(ThinkingDelta(thinking=piece.reasoning))
        if piece.content:
            if self._open != "text":
                await self._start_block(TextBlock(text=""))
            await self._block_delta(TextDelta(text=piece.content))
        for call in piece.tool_calls:
            block = tool_use(call)
            arguments = json.dumps(block.input, ensure_ascii=False)
            await self._start_block(replace(block, input={}))
            await self._block_delta(InputJsonDelta(partial_json=arguments))
            await self._close_block()

    async def end(self, piece: AnswerPiece, done: Done, reason: str) -> None:
        await self._blocks(piece)
        await self._close_block()
        stop_reason, sequence = _stop_reason(done, reason)
        await self._send(
            MessageDelta(
                delta=StopDelta(stop_reason=stop_reason, stop_sequence=sequence),
                usage=OutputUsage(output_tokens=done.completion_tokens),
            )
        )
        await self._send(MessageStop())

    async def error(self, error: ApiError) -> None:
        await self._out.send(error.anthropic_body(), event="error")

    async def whole(self, answer: WholeAnswer) -> web.StreamResponse:
        whole = answer.merged()
        content: list[Block] = []
        if whole.reasoning and self._thinking:
            content.append(ThinkingBlock(thinking=whole.reasoning))
        if whole.content:
            content.append(TextBlock(text=whole.content))
        content += [tool_use(call) for call in whole.tool_calls]
        reason, sequence = _stop_reason(answer.done, answer.reason)
        return json_view(
            replace(
                self._head,
                content=content,
                stop_reason=reason,
                stop_sequence=sequence,
                usage=usage(self._prompt_tokens, answer.done),
            )
        )
