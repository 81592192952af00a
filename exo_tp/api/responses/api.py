"""OpenAI's Responses API (`POST /v1/responses`) over the same generation path as chat
completions: input items through the chat template, function calls parsed by the model's mlx-lm
tool parser, the Response object and its typed stream events. Nothing is stored, so stored
conversations (`previous_response_id`, `store: true`) get a 400; hosted tools are left out of
what the model sees (left_out.py)."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from aiohttp import web

from exo_tp.api.backend import Backend
from exo_tp.api.core.answer_stream import AnswerPiece
from exo_tp.api.core.chat_prompt import Prompt, served_chat_prompt
from exo_tp.api.core.errors import ApiError
from exo_tp.api.core.generation import SseRenderer, WholeAnswer, respond
from exo_tp.api.core.generation_request import Ask, check_model, request_id
from exo_tp.api.core.left_out import leave_out
from exo_tp.api.core.structured import response_format
from exo_tp.api.http_io import off_loop, read_body, validate
from exo_tp.api.responses.schema import REFUSED, ResponsesRequest
from exo_tp.api.responses.shapes import (
    ArgumentsDelta,
    ArgumentsDone,
    ErrorEvent,
    FunctionCallOutput,
    IncompleteDetails,
    InputTokensDetails,
    ItemEvent,
    MessageOutput,
    OutputItem,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    PartEvent,
    ReasoningOutput,
    ReasoningText,
    ReasoningTextDelta,
    ReasoningTextDone,
    ResponseEvent,
    ResponseObject,
    Status,
    StreamEvent,
    Usage,
)
from exo_tp.frozen import replace
from exo_tp.wire.runtime import Constraint, Delta, Done


def _refuse_unsupported(body: Any) -> None:
    """A 400 naming a field that needs what this cluster lacks (stored state, hosted work)."""
    if not isinstance(body, dict):
        return
    for name, why in REFUSED.items():
        if body.get(name) not in (None, False, 0):
            raise ApiError(
                400,
                f"Unsupported parameter: '{name}': {why}.",
                param=name,
                code="unsupported_parameter",
            )


def _prompt(node: Backend, parsed: ResponsesRequest) -> Prompt:
    return served_chat_prompt(node, parsed.chat())


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Output:
    """The response's output items, built piece by piece; each step returns the stream events
    it makes (a whole answer uses only the finished items)."""

    def __init__(self) -> None:
        self.items: list[OutputItem] = []
        self._open: MessageOutput | ReasoningOutput | None = None  # the item being written
        self._text = ""

    def _begin(self, item: MessageOutput | ReasoningOutput) -> list[StreamEvent]:
        events = self._close()
        self._open, self._text = item, ""
        self.items.append(item)
        index = len(self.items) - 1
        empty = OutputText(text="") if isinstance(item, MessageOutput) else ReasoningText(text="")
        return [
            *events,
            ItemEvent(
                type="response.output_item.added",
                output_index=index,
                item=item.model_copy(deep=True),
            ),
            PartEvent(
                type="response.content_part.added", item_id=item.id, output_index=index, part=empty
            ),
        ]

    def piece(self, piece: AnswerPiece) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        if piece.reasoning:
            if not isinstance(self._open, ReasoningOutput):
                events += self._begin(ReasoningOutput(id=_id("rs"), status="in_progress"))
            assert self._open is not None
            self._text += piece.reasoning
            events.append(
                ReasoningTextDelta(
                    item_id=self._open.id, output_index=len(self.items) - 1, delta=piece.reasoning
                )
            )
        if piece.content:
            if not isinstance(self._open, MessageOutput):
                events += self._begin(MessageOutput(id=_id("msg"), status="in_progress"))
            assert self._open is not None
            self._text += piece.content
            events.append(
                OutputTextDelta(
                    item_id=self._open.id, output_index=len(self.items) - 1, delta=piece.content
                )
            )
        for call in piece.tool_calls:
            events += self._close()
            item = FunctionCallOutput(
                id=_id("fc"),
                call_id=call.get("id") or _id("call"),
                name=call["function"]["name"],
                arguments=call["function"]["arguments"],
                status="completed",
            )
            self.items.append(item)
            index = len(self.items) - 1
            started = replace(item, arguments="", status="in_progress")
            events += [
                ItemEvent(type="response.output_item.added", output_index=index, item=started),
                ArgumentsDelta(item_id=item.id, output_index=index, delta=item.arguments),
                ArgumentsDone(item_id=item.id, output_index=index, arguments=item.arguments),
                ItemEvent(type="response.output_item.done", output_index=index, item=item),
            ]
        return events

    def _close(self) -> list[StreamEvent]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.items.index(item)
        item.status = "completed"
        done: StreamEvent
        part: OutputText | ReasoningText
        if isinstance(item, ReasoningOutput):
            part = ReasoningText(text=self._text)
            item.content = [part]
            done = ReasoningTextDone(item_id=item.id, output_index=index, text=self._text)
        else:
            part = OutputText(text=self._text)
            item.content = [part]
            done = OutputTextDone(item_id=item.id, output_index=index, text=self._text)
        return [
            done,
            PartEvent(
                type="response.content_part.done", item_id=item.id, output_index=index, part=part
            ),
            ItemEvent(type="response.output_item.done", output_index=index, item=item),
        ]

    def finish(self) -> list[StreamEvent]:
        return self._close()


class _Head:
    """The Response object's fields that echo the request."""

    def __init__(self, node: Backend, parsed: ResponsesRequest):
        self._node, self._parsed = node, parsed
        self.id = _id("resp")
        self.created = int(time.time())

    def response(
        self, status: Status, output: list[OutputItem], done: Done | None
    ) -> ResponseObject:
        parsed = self._parsed
        usage, completed, incomplete = None, None, None
        if done is not None:
            usage = Usage(
                input_tokens=done.prompt_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=done.cached_tokens),
                output_tokens=done.completion_tokens,
                total_tokens=done.prompt_tokens + done.completion_tokens,
            )
            completed = int(time.time())
            if status == "incomplete":
                incomplete = IncompleteDetails(reason="max_output_tokens")
        return ResponseObject(
            id=self.id,
            created_at=self.created,
            completed_at=completed,
            status=status,
            model=self._node.model,
            instructions=parsed.instructions,
            max_output_tokens=parsed.max_output_tokens,
            max_tool_calls=parsed.max_tool_calls,
            parallel_tool_calls=parsed.parallel_tool_calls is not False,
            temperature=parsed.temperature,
            top_p=parsed.top_p,
            tool_choice=parsed.tool_choice or "auto",
            tools=parsed.functions(),
            truncation=parsed.truncation or "disabled",
            metadata=parsed.metadata or {},
            user=parsed.user,
            incomplete_details=incomplete,
            output=[item.model_copy(deep=True) for item in output],
            usage=usage,
        )


Ending = Literal["response.completed", "response.incomplete"]


def _status(done: Done) -> Status:
    return "incomplete" if done.finish_reason == "length" else "completed"


async def responses(node: Backend, request: web.Request) -> web.StreamResponse:
    body = await read_body(request)
    _refuse_unsupported(body)
    parsed = validate(ResponsesRequest, body)
    node = check_model(node, parsed.model)
    leave_out(request, parsed.left_out())
    ask = Ask(
        id=request_id("resp"),
        prompt=await off_loop(_prompt, node, parsed),
        sampling=parsed.sampling(),
        max_tokens=parsed.max_output_tokens,
        stream=parsed.stream,
        prompt_param="input",
        max_calls=parsed.max_calls(),
        constraint=_text_format(parsed),
        constraint_param="text.format.schema",
    )
    return await respond(node, request, ask, _Response(_Head(node, parsed)))


def _text_format(parsed: ResponsesRequest) -> Constraint | None:
    form = parsed.text.format if parsed.text else None
    return response_format(form.type, form.schema_, "text.format.schema") if form else None


class _Response(SseRenderer):
    """The Response object, whole or as its numbered stream events."""

    def __init__(self, head: _Head):
        self._head = head
        self._output = _Output()
        self._sequence = 0

    async def _send(self, made: list[StreamEvent]) -> None:
        for one in made:
            one.sequence_number = self._sequence
            await self._out.send(one.model_dump(), event=one.type)
            self._sequence += 1

    async def start(self) -> None:
        started = self._head.response("in_progress", [], None)
        await self._send(
            [
                ResponseEvent(type="response.created", response=started),
                ResponseEvent(type="response.in_progress", response=started),
            ]
        )

    async def delta(self, piece: AnswerPiece, delta: Delta) -> None:
        await self._send(self._output.piece(piece))

    async def end(self, piece: AnswerPiece, done: Done, reason: str) -> None:
        await self._send(self._output.piece(piece))
        await self._send(self._output.finish())
        status = _status(done)
        kind: Ending = "response.completed" if status == "completed" else "response.incomplete"
        final = self._head.response(status, self._output.items, done)
        await self._send([ResponseEvent(type=kind, response=final)])

    async def error(self, error: ApiError) -> None:
        await self._send([ErrorEvent(code=error.code, message=error.message, param=error.param)])

    async def whole(self, answer: WholeAnswer) -> web.StreamResponse:
        for piece in answer.pieces:  # piece by piece: text after a call is an item of its own
            self._output.piece(piece)
        self._output.finish()
        response = self._head.response(_status(answer.done), self._output.items, answer.done)
        return web.json_response(response.model_dump())
