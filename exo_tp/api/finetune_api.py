"""OpenAI's files and fine-tuning endpoints (https://platform.openai.com/docs/api-reference).

The leader keeps the files and runs the jobs: another node passes these requests on to it as
they are (method, query, body), signed for the leader's cluster listener, like generation.
Uploads are multipart (``file`` and ``purpose``), within the API's body limit (`MAX_BODY`);
a bad JSONL line is a 400 naming its line.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from email.parser import BytesParser
from email.policy import HTTP
from typing import Protocol, TypeVar

from aiohttp import web
from pydantic import BaseModel
from yarl import URL

from exo_tp.api.core.errors import ApiError, api_path
from exo_tp.api.http_io import MAX_BODY, read_body, validate
from exo_tp.api.proxy import Upstream, pass_through
from exo_tp.finetune.openai_schema import (
    Checkpoint,
    CheckpointList,
    CreateJob,
    EventList,
    FileDeleted,
    FileList,
    FileObject,
    Job,
    JobEvent,
    JobList,
)

ADAPTER_NAMES = ("adapters.safetensors", "adapter_config.json")
MAX_LIST = 100


class FineTuningService(Protocol):
    """What the node's fine-tuning offers the API (exo_tp.node.finetune.jobs.FineTuning)."""

    def upload(self, filename: str, raw: bytes, purpose: str) -> FileObject: ...
    def files(self) -> list[FileObject]: ...
    def file(self, file_id: str) -> FileObject: ...
    def content(self, file_id: str) -> bytes: ...
    def delete(self, file_id: str) -> None: ...
    async def create(self, body: CreateJob) -> Job: ...
    def jobs(self) -> list[Job]: ...
    def job(self, job_id: str) -> Job: ...
    def events(self, job_id: str) -> list[JobEvent]: ...
    def checkpoints(self, job_id: str) -> list[Checkpoint]: ...
    async def cancel(self, job_id: str) -> Job: ...
    def adapter_file(self, job_id: str, name: str) -> bytes: ...


class Leader(Protocol):
    fine_tuning: FineTuningService

    def generation_upstream(self) -> Upstream | None: ...
    def forward_headers(self, path: str, body: bytes) -> dict[str, str]: ...


def parse_form(content_type: str, raw: bytes) -> dict[str, tuple[str | None, bytes]]:
    """A multipart/form-data body's fields: name -> (file name, bytes). The body was read
    whole already (within the API's limit), so it is parsed from memory."""
    message = BytesParser(policy=HTTP).parsebytes(
        b"Content-Type: " + content_type.encode("latin-1", "replace") + b"\r\n\r\n" + raw
    )
    if not message.is_multipart():
        raise ApiError(400, "malformed multipart body")
    fields: dict[str, tuple[str | None, bytes]] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if isinstance(name, str):
            payload = part.get_payload(decode=True)
            fields[name] = (part.get_filename(), payload if isinstance(payload, bytes) else b"")
    return fields


def _view(view: BaseModel) -> web.Response:
    return web.json_response(view.model_dump(mode="json"))


def _limit(request: web.Request) -> int:
    raw = request.query.get("limit", "20")
    try:
        limit = int(raw)
    except ValueError:
        raise ApiError(400, f"Invalid value for 'limit': '{raw[:20]}'", param="limit") from None
    if not 1 <= limit <= MAX_LIST:
        raise ApiError(400, f"'limit' must be between 1 and {MAX_LIST}", param="limit")
    return limit


class _Listed(Protocol):
    @property
    def id(self) -> str: ...


Listed = TypeVar("Listed", bound=_Listed)


def _page(items: list[Listed], request: web.Request) -> tuple[list[Listed], bool]:
    """OpenAI's cursor pagination: the items after the one with id ``after``."""
    after = request.query.get("after")
    if after is not None:
        ids = [item.id for item in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    limit = _limit(request)
    return items[:limit], len(items) > limit


async def forward(request: web.Request, node: Leader, upstream: Upstream) -> web.StreamResponse:
    """The request as it came, to the leader's same endpoint; its answer as it comes back."""
    body = await request.read()
    url = URL(upstream.url + api_path(request.path)).with_query(request.query)
    return await pass_through(
        request,
        upstream.node,
        str(url),
        body,
        node.forward_headers(url.path, body),
        method=request.method,
        content_type=request.headers.get("Content-Type"),
        timeout_s=60,
    )


Handler = Callable[[web.Request, FineTuningService], Awaitable[web.StreamResponse]]
Route = Callable[[web.Request], Awaitable[web.StreamResponse]]


def add_routes(table: web.RouteTableDef, node_of: Callable[[web.Request], Leader]) -> None:
    """The fine-tuning routes on ``table``; ``node_of(request)`` is the node serving it."""
    for method, path, handler in ROUTES:
        table.route(method, path)(_on_leader(node_of, handler))


def _on_leader(node_of: Callable[[web.Request], Leader], handler: Handler) -> Route:
    """``handler`` where the leader keeps the files and jobs; elsewhere, passed on to it."""

    async def route(request: web.Request) -> web.StreamResponse:
        node = node_of(request)
        upstream = node.generation_upstream()
        if upstream is not None:
            return await forward(request, node, upstream)
        return await handler(request, node.fine_tuning)

    return route


# ---- the handlers, on the leader ----------------------------------------------------------


async def _upload(request: web.Request, ft: FineTuningService) -> web.StreamResponse:
    if not request.content_type.startswith("multipart/form-data"):
        raise ApiError(400, "upload a file as multipart/form-data (fields 'file', 'purpose')")
    try:
        raw_body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(
            413, f"the file is larger than the limit of {MAX_BODY} bytes", code="file_too_large"
        ) from None
    fields = parse_form(request.headers.get("Content-Type", ""), raw_body)
    file, purpose = fields.get("file"), fields.get("purpose")
    if file is None:
        raise ApiError(400, "Missing required parameter: 'file'.", param="file")
    if purpose is None:
        raise ApiError(400, "Missing required parameter: 'purpose'.", param="purpose")
    filename, raw = file
    purpose_text = purpose[1].decode("utf-8", "replace").strip()
    return _view(ft.upload(filename or "upload.jsonl", raw, purpose_text))


async def _list_files(request: web.Request, ft: FineTuningService) -> web.StreamResponse:
    purpose = request.query.get("purpose")
    files = [f for f in ft.files() if purpose is None or f.purpose == purpose]
    page, more = _page(files, request) if "limit" in request.query else (files, False)
    return _view(FileList(data=tuple(page), has_more=more))


async def _get_file(request: web.Request, ft: FineTuningService) -> web.StreamResponse:
    return _view(ft.file(request.match_info["file_id"]))


async def _file_content(request: web.Request, ft: FineTuningService) -> web.StreamResponse:
    data = ft.content(request.match_info["file_id"])
    return web.Response(body=data, content_type="application/octet-stream")


async def _delete_file(request: web.Request, ft: FineTuningService) -> web.StreamResponse:
    file_id = request.match_info["file_id"]
    ft.delete(file_id)
    return _view(FileDeleted(id=file_id))


async def _create_job(request: web.Request, ft: FineTuningService) -> web.StreamResponse:
    body = validate(CreateJob, await read_body(request))
    return _view(await ft.create(body))


async def _list_jobs(request: web.Request, ft: FineTuningService) -> web.StreamResponse:
    page, more = _page(ft.jobs(), request)
    return _view(JobList(data=tuple(page), has_more=more))


async def _get_job(request: web.Request, ft: FineTuningService) -> web.StreamResponse:
    return _view(ft.job(request.match_info["job_id"]))


async def _job_events(request: web.Request, ft: FineTuningService) -> web.StreamResponse:
    page, more = _page(ft.events(request.match_info["job_id"]), request)
    return _view(EventList(data=tuple(page), has_more=more))


async def _job_checkpoints(request: web.Request, ft: FineTuningService) -> web.StreamResponse:
    page, more = _page(ft.checkpoints(request.match_info["job_id"]), request)
    first, last = (page[0].id, page[-1].id) if page else (None, None)
    return _view(CheckpointList(data=tuple(page), has_more=more, first_id=first, last_id=last))


async def _cancel_job(request: web.Request, ft: FineTuningService) -> web.StreamResponse:
    return _view(await ft.cancel(request.match_info["job_id"]))


async def _adapter(request: web.Request, ft: FineTuningService) -> web.StreamResponse:
    name = request.match_info["name"]
    if name not in ADAPTER_NAMES:
        raise ApiError(404, f"no adapter file '{name[:100]}': one of {', '.join(ADAPTER_NAMES)}")
    data = ft.adapter_file(request.match_info["job_id"], name)
    return web.Response(
        body=data,
        content_type="application/octet-stream",
        headers={"Content-Disposition": f'attachment; filename="{name}"'},
    )


# Method, path and handler of each route, in the order they are added.
ROUTES: tuple[tuple[str, str, Handler], ...] = (
    ("POST", "/v1/files", _upload),
    ("GET", "/v1/files", _list_files),
    ("GET", "/v1/files/{file_id}", _get_file),
    ("GET", "/v1/files/{file_id}/content", _file_content),
    ("DELETE", "/v1/files/{file_id}", _delete_file),
    ("POST", "/v1/fine_tuning/jobs", _create_job),
    ("GET", "/v1/fine_tuning/jobs", _list_jobs),
    ("GET", "/v1/fine_tuning/jobs/{job_id}", _get_job),
    ("GET", "/v1/fine_tuning/jobs/{job_id}/events", _job_events),
    ("GET", "/v1/fine_tuning/jobs/{job_id}/checkpoints", _job_checkpoints),
    ("POST", "/v1/fine_tuning/jobs/{job_id}/cancel", _cancel_job),
    ("GET", "/v1/fine_tuning/jobs/{job_id}/adapter/{name}", _adapter),
)
