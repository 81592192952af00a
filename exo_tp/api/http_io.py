"""Reading request bodies and writing streamed answers (server-sent events, NDJSON lines),
shared by every dialect; tokenizer work off the event loop."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

from aiohttp import web
from pydantic import BaseModel, ConfigDict, ValidationError

from exo_tp.api.core.errors import ApiError
from exo_tp.api.core.json_body import parse_json
from exo_tp.api.core.validation import validation_error

# A request with images: a 16 MB file as base64 with its conversation (docs/api.md).
MAX_BODY = 24 * 1024 * 1024
T = TypeVar("T")
Model = TypeVar("Model", bound=BaseModel)

# One thread: chat templates and tokenizing a 4 MB prompt must not stall the event loop, and
# Hugging Face tokenizers are not safe to use from several threads at once.
_TOKENIZER_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")


async def off_loop(work: Callable[..., T], *args: Any) -> T:
    return await asyncio.get_running_loop().run_in_executor(_TOKENIZER_THREAD, work, *args)


async def read_body(request: web.Request) -> Any:
    """The request's JSON (checked by `parse_json`); 413 past the size limit."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(
            413, f"request body larger than {MAX_BODY} bytes", code="request_too_large"
        ) from None
    return parse_json(raw)


def validate(model: type[Model], body: Any) -> Model:
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as error:
        raise validation_error(error) from None
    except RecursionError:  # unreachable after parse_json's depth limit; kept as a backstop
        raise ApiError(400, "request body is nested too deeply") from None


class ApiView(BaseModel):
    """A response body, typed. A field left unset is left out of the JSON (OpenAI leaves out
    e.g. ``reasoning``); one set to None is null. Built field by field, so assignments are
    validated too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def body(self) -> dict[str, Any]:
        """The JSON object it is sent as (the edge where a view becomes plain data)."""
        return self.model_dump(mode="json", exclude_unset=True)


def json_view(view: ApiView) -> web.Response:
    return web.json_response(view.body())


class _Streamed:
    """A streamed response: prepared once, written piece by piece, then ended."""

    content_type = ""  # each kind's

    def __init__(self, request: web.Request):
        self._request = request
        self.response = web.StreamResponse(
            headers={"Content-Type": self.content_type, "Cache-Control": "no-cache"}
        )

    async def open(self) -> None:
        await self.response.prepare(self._request)

    async def close(self) -> web.StreamResponse:
        await self.response.write_eof()
        return self.response


class EventStream(_Streamed):
    """A text/event-stream response: ``data:`` lines, optionally with ``event:`` names."""

    content_type = "text/event-stream"

    async def send(self, payload: ApiView | dict[str, Any] | str, event: str | None = None) -> None:
        if isinstance(payload, ApiView):
            payload = payload.body()
        data = payload if isinstance(payload, str) else json.dumps(payload)
        head = f"event: {event}\n" if event else ""
        await self.response.write(f"{head}data: {data}\n\n".encode())


class Line(Protocol):
    """A typed reply that gives its own JSON object (Ollama's views)."""

    def body(self) -> dict[str, Any]: ...


class NdjsonStream(_Streamed):
    """An NDJSON response (Ollama's streams): one JSON object a line."""

    content_type = "application/x-ndjson"

    async def send(self, line: Line) -> None:
        await self.response.write((json.dumps(line.body()) + "\n").encode())
