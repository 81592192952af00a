"""Anthropic's response shapes: a message, whole or as stream events, as typed views (unlike
OpenAI's, every field is always sent; a block's or event's ``type`` is a constant of its
class)."""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from exo_tp.api.http_io import ApiView as _View
from exo_tp.wire.runtime import Done


class ApiView(_View):
    def body(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class Usage(ApiView):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int
    cache_creation_input_tokens: int


class ThinkingBlock(ApiView):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""


class TextBlock(ApiView):
    type: Literal["text"] = "text"
    text: str


class ToolUseBlock(ApiView):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]  # the call's arguments: whatever JSON object the model wrote


Block = ThinkingBlock | TextBlock | ToolUseBlock


class Message(ApiView):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[Block]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage


class TokenCount(ApiView):
    input_tokens: int


# ---- stream events -------------------------------------------------------------------------


class MessageStart(ApiView):
    type: Literal["message_start"] = "message_start"
    message: Message


class Ping(ApiView):
    type: Literal["ping"] = "ping"


class ContentBlockStart(ApiView):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: Block


class ThinkingDelta(ApiView):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class TextDelta(ApiView):
    type: Literal["text_delta"] = "text_delta"
    text: str


class InputJsonDelta(ApiView):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ContentBlockDelta(ApiView):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: ThinkingDelta | TextDelta | InputJsonDelta


class ContentBlockStop(ApiView):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class StopDelta(ApiView):
    stop_reason: str
    stop_sequence: str | None


class OutputUsage(ApiView):
    output_tokens: int


class MessageDelta(ApiView):
    type: Literal["message_delta"] = "message_delta"
    delta: StopDelta
    usage: OutputUsage


class MessageStop(ApiView):
    type: Literal["message_stop"] = "message_stop"


Event = (
    MessageStart
    | Ping
    | ContentBlockStart
    | ContentBlockDelta
    | ContentBlockStop
    | MessageDelta
    | MessageStop
)


def usage(prompt_tokens: int, done: Done | None) -> Usage:
    cached = done.cached_tokens if done else 0
    return Usage(
        input_tokens=prompt_tokens - cached,
        output_tokens=done.completion_tokens if done else 0,
        cache_read_input_tokens=cached,
        cache_creation_input_tokens=0,
    )


def tool_use(call: dict[str, Any]) -> ToolUseBlock:
    """An OpenAI-shaped call (mlx_lm's tool parser, well formed) as a tool_use block."""
    return ToolUseBlock(
        id=f"toolu_{uuid.uuid4().hex[:24]}",
        name=call["function"]["name"],
        input=json.loads(call["function"]["arguments"]),
    )
