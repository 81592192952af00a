"""Passing a generation request through to the leader, and its answer back.

Whatever happens to the leader, the client gets a well-formed answer: a 503 JSON error while
nothing was sent yet; once a stream started, an SSE error event (``data: {"error": ...}``) and a
clean end of the chunked body, without ``[DONE]``, which OpenAI clients raise as an APIError.
Only whole SSE events are passed on, so an event cut by the leader's death never reaches the
client half-written.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from exo_tp.api.core.errors import ApiError, not_ready
from exo_tp.api.core.refusals import CLIENT_HEADER, PASSED_ON

log = logging.getLogger(__name__)

# The client's credentials and request id go to the leader, which checks them too; its user
# agent, for the leader's log line if it refuses the request.
FORWARDED = ("Authorization", "x-api-key", "x-request-id", "User-Agent")
_HOP_HEADERS = {
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "host",
    "content-encoding",
}
EVENT_END = b"\n\n"


@dataclass(frozen=True)
class Upstream:
    """Where this node passes generation requests: the leader's cluster listener. Clients are
    told the leader's node id, never this address (an internal port, useless to them)."""

    node: str  # the leader's node id
    url: str  # its cluster listener, under FORWARD_PREFIX


def _lost(leader: str, when: str) -> ApiError:
    return ApiError(
        503,
        f"the leader (node {leader}) went away {when}; the cluster is re-planning, retry shortly",
        kind="server_error",
        code="cluster_not_ready",
        retry_after=5,
    )


def _headers_back(upstream: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_HEADERS}


async def pass_through(
    request: web.Request,
    leader: str,
    url: str,
    body: bytes,
    extra_headers: dict[str, str] | None = None,
    *,
    method: str = "POST",
    content_type: str | None = "application/json",
    timeout_s: float | None = None,
) -> web.StreamResponse:
    """Send ``body`` to ``url`` (the same endpoint on ``leader``, a node id) with ``method``
    and answer with its response. ``timeout_s`` bounds the whole exchange (None: a stream
    may run for long)."""
    headers = {k: request.headers[k] for k in FORWARDED if k in request.headers}
    headers[CLIENT_HEADER] = request.remote or "?"
    headers.update(extra_headers or {})
    if content_type is not None:
        headers["Content-Type"] = content_type
    timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=3)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        try:
            upstream = await session.request(method, url, data=body, headers=headers)
        except (aiohttp.ClientConnectorError, TimeoutError):
            raise not_ready(f"the leader (node {leader}) is unreachable") from None
        except aiohttp.ClientError:  # connected, then lost before the answer's headers
            raise _lost(leader, "before it answered") from None
        async with upstream:
            request[PASSED_ON] = leader  # the leader logs a refusal of it
            if upstream.content_type == "text/event-stream":
                return await _relay_events(request, upstream, leader)
            try:
                payload = await upstream.read()
            except (aiohttp.ClientError, TimeoutError):
                raise _lost(leader, "before it answered") from None
            return web.Response(
                status=upstream.status, body=payload, headers=_headers_back(upstream)
            )


async def _relay_events(
    request: web.Request, upstream: aiohttp.ClientResponse, leader: str
) -> web.StreamResponse:
    response = web.StreamResponse(status=upstream.status, headers=_headers_back(upstream))
    await response.prepare(request)
    pending = b""
    try:
        while True:
            try:
                chunk = await upstream.content.readany()
            except (aiohttp.ClientError, TimeoutError):
                await response.write(
                    f"data: {json.dumps(_lost(leader, 'mid-stream').body())}\n\n".encode()
                )
                break
            if not chunk:  # the leader ended the stream itself
                if pending:
                    await response.write(pending)
                break
            pending += chunk
            cut = pending.rfind(EVENT_END) + len(EVENT_END)
            if cut >= len(EVENT_END):
                await response.write(pending[:cut])
                pending = pending[cut:]
        await response.write_eof()
    except ConnectionResetError:  # the client left; nothing more to tell it
        log.debug("client left a proxied stream")
    return response
