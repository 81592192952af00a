"""Signed node-to-node HTTP: the one client and the one route helper (control, weights, ...).

Every request carries an HMAC of time, path and body with the cluster secret
(exo_tp.security.signing; the secret itself never travels). Bodies are typed models, replies
typed models (or raw bytes, or a stream of them for weights), refusals a WireError.

Client: ``SignedClient(secret).call(peer, path, body, Reply)``, where ``peer`` is the base URL of
the peer's routes (``http://host:port`` or ``http://host:port/weights``); ``stream`` yields the
response to read a byte body in chunks. Any status but 200 raises PeerRefused.

Server: ``signed_app(secret, [post(path, Body, handle), get(path, handle)])``; the handler gets
the validated body and returns a model, bytes or a Stream, or raises PeerRefused.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlparse

import aiohttp
from aiohttp import web
from pydantic import BaseModel, ValidationError

from exo_tp.security.signing import control_headers, control_request_ok
from exo_tp.wire.errors import PeerRefused, UnsignedReply, WireError

TIMEOUT = aiohttp.ClientTimeout(total=3)
MAX_BODY = 1 << 20  # aiohttp's default; the control routes allow more (big transfer plans)

R = TypeVar("R", bound=BaseModel)


# ---- client ----------------------------------------------------------------------------------


def _refusal(raw: bytes, status: int) -> PeerRefused:
    try:
        return PeerRefused(WireError.model_validate_json(raw).error, status)
    except ValidationError:  # not one of ours (a proxy, a crash): keep what it said, briefly
        said = raw[:300].decode(errors="replace").strip()
        return PeerRefused(f"HTTP {status}" + (f": {said}" if said else ""), status)


class SignedClient:
    """Signed requests to peers; one session, made on first use unless one is given."""

    def __init__(
        self,
        secret: str,
        session: aiohttp.ClientSession | None = None,
        timeout: aiohttp.ClientTimeout = TIMEOUT,
    ):
        self.secret = secret
        self._session, self._own, self._timeout = session, session is None, timeout

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        return self._session

    @contextlib.asynccontextmanager
    async def stream(
        self, peer: str, path: str, body: BaseModel | None
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """The 200 response to read as it comes (POST ``body``, or GET without one)."""
        data = body.model_dump_json().encode() if body is not None else b""
        headers = {
            "Content-Type": "application/json",
            **control_headers(self.secret, urlparse(peer).path + path, data),
        }
        method = "GET" if body is None else "POST"
        async with self.session.request(method, peer + path, data=data, headers=headers) as answer:
            if answer.status != 200:
                raise _refusal(await answer.read(), answer.status)
            yield answer

    async def read(
        self, peer: str, path: str, body: BaseModel | None, *, signed_reply: bool = False
    ) -> bytes:
        """The whole reply body; ``signed_reply``: only if the peer signed it with the secret."""
        async with self.stream(peer, path, body) as answer:
            raw = await answer.read()
            headers = dict(answer.headers)
        if signed_reply and not control_request_ok(
            self.secret, urlparse(peer).path + path, raw, headers
        ):
            raise UnsignedReply(f"{peer}{path}: the reply is not signed with the cluster secret")
        return raw

    async def call(
        self,
        peer: str,
        path: str,
        body: BaseModel | None,
        reply: type[R],
        *,
        signed_reply: bool = False,
    ) -> R:
        return reply.model_validate_json(
            await self.read(peer, path, body, signed_reply=signed_reply)
        )

    async def close(self) -> None:
        if self._own and self._session is not None:
            await self._session.close()


# ---- server ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stream:
    """A byte body sent in chunks as they are produced (its length known up front)."""

    length: int
    chunks: AsyncIterator[bytes]


Answer = BaseModel | bytes | Stream


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    body: type[BaseModel] | None
    handle: Callable[..., Awaitable[Answer]]
    sign_reply: bool = False  # the receiver must trust the reply itself (a manifest's digests)


def post(
    path: str,
    body: type[BaseModel],
    handle: Callable[[Any], Awaitable[Answer]],
    *,
    sign_reply: bool = False,
) -> Route:
    return Route("POST", path, body, handle, sign_reply)


def get(path: str, handle: Callable[[], Awaitable[Answer]]) -> Route:
    return Route("GET", path, None, handle)


def refuse(status: int, message: str) -> web.Response:
    """A signed route's refusal: a `WireError` body, whatever the status."""
    return web.Response(
        body=WireError(error=message).model_dump_json(),
        status=status,
        content_type="application/json",
    )


def _handler(secret: str, route: Route) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handler(request: web.Request) -> web.StreamResponse:
        try:
            args = [route.body.model_validate_json(await request.read())] if route.body else []
        except ValidationError as bad:
            return refuse(400, f"bad request: {bad.errors()[0]['msg']}")
        try:
            answer = await route.handle(*args)
        except PeerRefused as refused:
            return refuse(refused.status, refused.error)
        if isinstance(answer, Stream):
            response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
            response.content_length = answer.length
            await response.prepare(request)
            async for chunk in answer.chunks:
                await response.write(chunk)
            await response.write_eof()
            return response
        if isinstance(answer, bytes):
            body, kind = answer, "application/octet-stream"
        else:
            body, kind = answer.model_dump_json().encode(), "application/json"
        headers = control_headers(secret, request.path, body) if route.sign_reply else None
        return web.Response(body=body, content_type=kind, headers=headers)

    return handler


def signed_app(
    secret: str, routes: Sequence[Route], *, client_max_size: int = MAX_BODY
) -> web.Application:
    """The routes, each refusing (401) a request without a valid signature."""

    @web.middleware
    async def signed(
        request: web.Request,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        if not control_request_ok(
            secret, request.path, await request.read(), dict(request.headers)
        ):
            return refuse(401, "bad or missing signature")
        return await handler(request)

    app = web.Application(middlewares=[signed], client_max_size=client_max_size)
    app.add_routes([web.route(r.method, r.path, _handler(secret, r)) for r in routes])
    return app
