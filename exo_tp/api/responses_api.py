"""OpenAI's Responses API (`POST /v1/responses`) over the same generation path as chat
completions: input items through the chat template, function calls parsed by the model's mlx-lm
tool parser, the Response object and its typed stream events. Nothing is stored, so stored
conversations (`previous_response_id`, `store: true`) and hosted tools get a 400."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from exo_tp.api.answer_stream import AnswerPiece, AnswerStream
from exo_tp.api.backend import Backend, collect, first_event
from exo_tp.api.chat_prompt import Prompt, choose_tools, render_chat
from exo_tp.api.errors import ApiError
from exo_tp.api.generation_request import generate_request, sampling_params, token_budget
from exo_tp.api.http_io import EventStream, off_loop, read_body, validate
from exo_tp.api.openai_api import check_model
from exo_tp.api.responses_schema import REFUSED, ResponsesRequest
from exo_tp.api.responses_shapes import (
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
from exo_tp.wire.runtime import Delta, Done


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
    use = choose_tools(parsed.chat_tools(), parsed.chat_tool_choice(), node.tokenizer)
    return render_chat(
        node.tokenizer, parsed.chat_messages(), use, dict(node.defaults.chat_template_args)
    )


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
            tools=parsed.tools or [],
            truncation=parsed.truncation or "disabled",
            metadata=parsed.metadata or {},
            user=parsed.user,
            incomplete_details=incomplete,
            output=[item.model_copy(deep=True) for item in output],
            usage=usage,
        )


def _status(done: Done) -> Status:
    return "incomplete" if done.finish_reason == "length" else "completed"


def _finish(done: Done) -> str:
    return "length" if done.finish_reason == "length" else "stop"


async def responses(node: Backend, request: web.Request) -> web.StreamResponse:
    body = await read_body(request)
    _refuse_unsupported(body)
    parsed = validate(ResponsesRequest, body)
    check_model(node, parsed.model)
    prompt = await off_loop(_prompt, node, parsed)
    budget = token_budget(
        node, len(prompt.tokens), parsed.max_output_tokens, "input", "max_output_tokens"
    )
    sampling = sampling_params(node, parsed.sampling(), budget, logprobs=False, top_logprobs=0)
    generation = generate_request(node, "resp", prompt.tokens, sampling, [], "input")
    answer = AnswerStream(node.tokenizer, prompt, streaming=False, max_calls=parsed.max_calls())
    head = _Head(node, parsed)
    output = _Output()
    events = node.generate(generation)
    if parsed.stream:
        return await _stream(request, events, head, answer, output)
    deltas, done = await collect(events)
    for delta in deltas:
        output.piece(answer.feed(delta.text))
    output.piece(answer.finish(_finish(done)))
    output.finish()
    return web.json_response(head.response(_status(done), output.items, done).model_dump())


async def _stream(
    request: web.Request,
    events: AsyncIterator[Delta | Done],
    head: _Head,
    answer: AnswerStream,
    output: _Output,
) -> web.StreamResponse:
    event = await first_event(events)
    stream = EventStream(request)
    await stream.open()
    sequence = 0

    async def send(made: list[StreamEvent]) -> None:
        nonlocal sequence
        for one in made:
            one.sequence_number = sequence
            await stream.send(one.model_dump(), event=one.type)
            sequence += 1

    try:
        started = head.response("in_progress", [], None)
        await send(
            [
                ResponseEvent(type="response.created", response=started),
                ResponseEvent(type="response.in_progress", response=started),
            ]
        )
        while True:
            if isinstance(event, Delta):
                await send(output.piece(answer.feed(event.text)))
            else:
                await send(output.piece(answer.finish(_finish(event))))
                await send(output.finish())
                status = _status(event)
                kind = "response.completed" if status == "completed" else "response.incomplete"
                final = head.response(status, output.items, event)
                await send([ResponseEvent(type=kind, response=final)])
                break
            event = await anext(events)
    except ApiError as error:  # mid-stream failure: an error event, then the stream ends
        await send([ErrorEvent(code=error.code, message=error.message, param=error.param)])
    finally:
        await events.aclose()
    return await stream.close()
