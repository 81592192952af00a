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
from exo_tp.runtime.messages import Delta, Done


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
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the message or reasoning item being written
        self._text = ""

    def _begin(self, item: dict[str, Any], part: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close()
        self._open, self._text = item, ""
        self.items.append(item)
        index = len(self.items) - 1
        return [
            *events,
            {"type": "response.output_item.added", "output_index": index, "item": dict(item)},
            {
                "type": "response.content_part.added",
                "item_id": item["id"],
                "output_index": index,
                "content_index": 0,
                "part": part,
            },
        ]

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {
            "item_id": self._open["id"],
            "output_index": len(self.items) - 1,
            "content_index": 0,
        }

    def piece(self, piece: AnswerPiece) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if piece.reasoning:
            if self._open is None or self._open["type"] != "reasoning":
                item = {
                    "type": "reasoning",
                    "id": _id("rs"),
                    "summary": [],
                    "content": [],
                    "status": "in_progress",
                }
                events += self._begin(item, {"type": "reasoning_text", "text": ""})
            self._text += piece.reasoning
            events.append(
                {"type": "response.reasoning_text.delta", **self._where(), "delta": piece.reasoning}
            )
        if piece.content:
            if self._open is None or self._open["type"] != "message":
                item = {
                    "type": "message",
                    "id": _id("msg"),
                    "status": "in_progress",
                    "role": "assistant",
                    "content": [],
                }
                events += self._begin(item, _text_part(""))
            self._text += piece.content
            events.append(
                {
                    "type": "response.output_text.delta",
                    **self._where(),
                    "delta": piece.content,
                    "logprobs": [],
                }
            )
        for call in piece.tool_calls:
            events += self._close()
            item = {
                "type": "function_call",
                "id": _id("fc"),
                "call_id": call.get("id") or _id("call"),
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
            self.items.append(item)
            index = len(self.items) - 1
            where = {"item_id": item["id"], "output_index": index}
            events += [
                {
                    "type": "response.output_item.added",
                    "output_index": index,
                    "item": {**item, "arguments": "", "status": "in_progress"},
                },
                {
                    "type": "response.function_call_arguments.delta",
                    **where,
                    "delta": item["arguments"],
                },
                {
                    "type": "response.function_call_arguments.done",
                    **where,
                    "arguments": item["arguments"],
                },
                {"type": "response.output_item.done", "output_index": index, "item": item},
            ]
        return events

    def _close(self) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.items.index(item)
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        item["status"] = "completed"
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": self._text}
            item["content"] = [part]
            done = {"type": "response.reasoning_text.done", **where, "text": self._text}
        else:
            part = _text_part(self._text)
            item["content"] = [part]
            done = {
                "type": "response.output_text.done",
                **where,
                "text": self._text,
                "logprobs": [],
            }
        return [
            done,
            {"type": "response.content_part.done", **where, "part": part},
            {"type": "response.output_item.done", "output_index": index, "item": item},
        ]

    def finish(self) -> list[dict[str, Any]]:
        return self._close()


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class _Head:
    """The Response object's fields that echo the request."""

    def __init__(self, node: Backend, parsed: ResponsesRequest):
        self.id = _id("resp")
        self.created = int(time.time())
        self.fields: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": node.model,
            "instructions": parsed.instructions,
            "max_output_tokens": parsed.max_output_tokens,
            "max_tool_calls": parsed.max_tool_calls,
            "parallel_tool_calls": parsed.parallel_tool_calls is not False,
            "previous_response_id": None,
            "temperature": parsed.temperature,
            "top_p": parsed.top_p,
            "tool_choice": _tool_choice(parsed),
            "tools": [t.model_dump(exclude_unset=True) for t in parsed.tools or []],
            "text": {"format": {"type": "text"}},
            "truncation": parsed.truncation or "disabled",
            "metadata": parsed.metadata or {},
            "user": parsed.user,
            "store": False,
            "background": False,
            "error": None,
            "incomplete_details": None,
        }

    def response(
        self, status: str, output: list[dict[str, Any]], done: Done | None
    ) -> dict[str, Any]:
        body = {**self.fields, "status": status, "output": output, "usage": None}
        if done is not None:
            body["usage"] = {
                "input_tokens": done.prompt_tokens,
                "input_tokens_details": {
                    "cached_tokens": done.cached_tokens,
                    "cache_write_tokens": 0,
                },
                "output_tokens": done.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": done.prompt_tokens + done.completion_tokens,
            }
            body["completed_at"] = int(time.time())
            if status == "incomplete":
                body["incomplete_details"] = {"reason": "max_output_tokens"}
        return body


def _tool_choice(parsed: ResponsesRequest) -> Any:
    choice = parsed.tool_choice
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.model_dump()


def _status(done: Done) -> str:
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
    generation = generate_request("resp", prompt.tokens, sampling, [])
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
    return web.json_response(head.response(_status(done), output.items, done))


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

    async def send(payloads: list[dict[str, Any]]) -> None:
        nonlocal sequence
        for payload in payloads:
            await stream.send({**payload, "sequence_number": sequence}, event=payload["type"])
            sequence += 1

    try:
        started = head.response("in_progress", [], None)
        await send(
            [
                {"type": "response.created", "response": started},
                {"type": "response.in_progress", "response": started},
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
                await send([{"type": kind, "response": head.response(status, output.items, event)}])
                break
            event = await anext(events)
    except ApiError as error:  # mid-stream failure: an error event, then the stream ends
        await send(
            [{"type": "error", "code": error.code, "message": error.message, "param": error.param}]
        )
    finally:
        await events.aclose()
    return await stream.close()
