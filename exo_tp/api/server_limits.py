"""HTTP listeners that no client can exhaust: connection caps, read timeouts, JSON edges.

aiohttp bounds what a request may hold (``max_line_size``, ``max_field_size``, the body size)
and closes idle keep-alive connections (``keepalive_timeout``, which since 3.10 also runs from
the moment a connection opens), but it has no cap on connections, per client address or in
total, no deadline for a request's head, and no deadline for its body. Without them ~2,000
stalled connections, sent with no credentials, use up a node's file descriptors and the
cluster's own traffic fails with them (issue #21). So each listener here:

- counts its connections in total and per client address, and answers one over either cap at
  once with a short JSON 503/429 and closes it (accept-and-close frees the descriptor at once;
  a backlog of unaccepted connections would starve this node's own clients just the same);
- closes a connection whose first request head has not arrived within ``header_timeout``
  (aiohttp's keep-alive timer covers the heads of later requests);
- reads every request body before the handler runs, within ``body_timeout`` (408 past it);
- answers HTTP-level errors (a header over ``max_field_size``, a malformed request line) with
  the listener's JSON error shape, logged as one line without a traceback.

aiohttp's protocol stays in charge of HTTP; only the factory that makes it is wrapped (a
protocol-factory wrapper, not an accept loop). The public API and the cluster's own traffic
(control, status polls, weight transfer, requests passed to the leader) each get a listener
of their own with their own limits, see `exo_tp.node.node`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import LineTooLong
from aiohttp.web_protocol import RequestHandler
from pydantic import BaseModel, ConfigDict

from exo_tp.api.core.errors import ApiError
from exo_tp.wire.errors import WireError

log = logging.getLogger(__name__)

# (path of the failed request or "", HTTP status, message) -> the JSON body to answer with
ErrorShape = Callable[[str, int, str], dict[str, Any]]
_HEAD_END = b"\r\n\r\n"
# Refusals answered per second and listener; past it the listener pauses until the next second
REFUSALS_PER_SECOND = 200
_FIRST_LINE_MAX = 2048  # bytes of a request line kept to pick the error shape of a bad request


class ListenerStats(BaseModel):
    """One listener's connections now, and what it refused or timed out so far (/health)."""

    model_config = ConfigDict(frozen=True)
    open: int
    refused: int
    head_timeouts: int


@dataclass(frozen=True)
class Limits:
    """One listener's bounds. 0 for a cap or a timeout means none."""

    max_connections: int = 1024  # open connections in total
    max_per_address: int = 256  # open connections from one client address
    header_timeout: float = 10.0  # seconds for a new connection's first request head
    body_timeout: float = 60.0  # seconds to receive a request body, once its head arrived
    keepalive_timeout: float = 30.0  # seconds an idle keep-alive connection stays open
    max_field_size: int = 8190  # bytes of one header line (aiohttp's default)
    max_line_size: int = 8190  # bytes of the request line
    lingering_time: float = 2.0  # seconds spent draining an unread body before closing


_AT_START: tuple[int, int] | None = None


def remember_fd_limit() -> None:
    """Note the open-files limit before anything imports mlx_lm: importing ``mlx_lm.utils``
    sets it to (2048, 4096), lowering the hard limit of a machine that allows more."""
    global _AT_START
    if _AT_START is None:
        _AT_START = resource.getrlimit(resource.RLIMIT_NOFILE)


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft limit on open files to the hard one (the default soft limit, often
    1024, or mlx_lm's 2048, is what a flood meets first), and the hard one back to what it
    was at start where the process may. Returns (soft, hard) afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    first = _AT_START[1] if _AT_START is not None else hard
    for target in dict.fromkeys((first, hard)):
        if target == resource.RLIM_INFINITY:
            target = 1 << 20
        if soft != resource.RLIM_INFINITY and soft >= target:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, max(target, hard)))
            break
        except (ValueError, OSError):  # raising the hard limit needs CAP_SYS_RESOURCE
            continue
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def fd_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


def default_api_connections(limit: int | None = None) -> int:
    """The public API's connection cap when none is set: a quarter of the open-files limit
    (at most 4096), so public clients can never take the descriptors the cluster's own
    traffic, the worker's pipes and the model files need."""
    return max(32, min(4096, (limit if limit is not None else fd_limit()) // 4))


def default_cluster_connections(limit: int | None = None) -> int:
    """The cluster listener's cap: peers poll over one keep-alive connection each, and
    fetch weights over a few more."""
    return max(32, min(1024, (limit if limit is not None else fd_limit()) // 8))


def openai_shape(path: str, status: int, message: str) -> dict[str, Any]:
    del path
    return ApiError(status, message).body()


def plain_shape(path: str, status: int, message: str) -> dict[str, Any]:
    """The control plane's error body: the signed routes' `WireError`."""
    del path, status
    return WireError(error=message).model_dump()


class _Admission:
    """Open connections of one listener, in total and per client address."""

    def __init__(self, limits: Limits, name: str):
        self.limits, self.name = limits, name
        self.total = 0
        self.by_address: Counter[str] = Counter()
        self.refused = 0

    def admit(self, address: str) -> tuple[int, str] | None:
        """None, or why ``address`` may not open another connection (status, message)."""
        limits = self.limits
        if limits.max_connections and self.total >= limits.max_connections:
            return 503, (
                f"this node's {self.name} listener is full ({self.total} open connections, "
                f"its limit); retry shortly"
            )
        if limits.max_per_address and self.by_address[address] >= limits.max_per_address:
            return 429, (
                f"too many open connections from {address} ({limits.max_per_address}, this "
                f"node's limit per client address); close some or retry shortly"
            )
        self.total += 1
        self.by_address[address] += 1
        return None

    def release(self, address: str) -> None:
        self.total -= 1
        self.by_address[address] -= 1
        if self.by_address[address] <= 0:
            del self.by_address[address]


def _refusal(status: int, message: str, shape: ErrorShape) -> bytes:
    reason = {429: "Too Many Requests", 503: "Service Unavailable"}.get(status, "Error")
    body = json.dumps(shape("", status, message)).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class _JsonErrorHandler(RequestHandler):
    """aiohttp's protocol, answering what its parser refuses (a header over the size limit, a
    bad request line) as JSON in the listener's shape, logged without a traceback."""

    first_line = b""  # set by the guard: the connection's first request line, for the path
    shape: ErrorShape = staticmethod(openai_shape)

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:
            raise ConnectionError("response already started: cannot send an error")
        if isinstance(exc, LineTooLong):
            status = 431
            reason = (
                f"a request line or header is longer than {self.max_field_size} bytes (this "
                f"node's --max-header-size)"
            )
        else:
            reason = _short_reason(exc, message, status)
        path = _path_of(self.first_line)
        if status >= 500:
            log.error("HTTP error %d on %s from %s: %s", status, path, request.remote, reason)
        else:
            log.info("refused a malformed request on %s: %s", path or "?", reason)
        response = web.json_response(self.shape(path, status, reason), status=status)
        response.force_close()
        return response


def _short_reason(exc: BaseException | None, message: str | None, status: int) -> str:
    text = getattr(exc, "message", None) or message or (str(exc) if exc else "")
    text = " ".join(str(text).split())[:300]
    if status == 400:
        return f"bad HTTP request: {text}" if text else "bad HTTP request"
    return text or "internal server error"


def _path_of(line: bytes) -> str:
    parts = line.split(b" ")
    if len(parts) >= 2 and parts[1].startswith(b"/"):
        return parts[1].split(b"?")[0].decode("latin-1")[:300]
    return ""


class _Guard(asyncio.Protocol):
    """Admits a connection (or refuses it), then hands it to aiohttp's protocol, watching
    only for the end of its first request head."""

    def __init__(self, site: LimitedSite):
        self._site = site
        self._inner: _JsonErrorHandler | None = None
        self._address = ""
        self._transport: asyncio.Transport | None = None
        self._head_timer: asyncio.TimerHandle | None = None
        self._tail = b""
        self._line = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        refused = self._site.admission.admit(address)
        if refused is not None:
            self._site.refused(address, refused[1])
            transport.write(_refusal(*refused, self._site.shape))
            transport.close()
            return
        self._address = address
        inner = self._site.make_handler()
        self._inner = inner
        inner.connection_made(transport)
        timeout = self._site.limits.header_timeout
        if timeout > 0:
            self._head_timer = asyncio.get_running_loop().call_later(timeout, self._head_late)

    def _head_late(self) -> None:
        self._head_timer = None
        if self._transport is not None:
            self._site.timed_out += 1
            self._transport.abort()  # a stalled client gets no answer: it frees the fd now

    def data_received(self, data: bytes) -> None:
        if self._inner is None:
            return
        if len(self._line) < _FIRST_LINE_MAX and b"\r\n" not in self._line:
            self._line += data[: _FIRST_LINE_MAX - len(self._line)]
            self._inner.first_line = self._line.split(b"\r\n", 1)[0]
        if self._head_timer is not None:
            seen = self._tail + data
            if _HEAD_END in seen:
                self._head_timer.cancel()
                self._head_timer = None
            else:
                self._tail = seen[-3:]
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        if self._inner is not None:
            self._inner.eof_received()  # aiohttp's handler closes on EOF (returns None)
        return None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        inner, self._inner = self._inner, None
        if inner is not None:
            self._site.admission.release(self._address)
            inner.connection_lost(exc)


class LimitedSite(web.TCPSite):
    """A TCPSite whose connections go through `_Guard`."""

    def __init__(
        self,
        runner: web.AppRunner,
        host: str,
        port: int,
        limits: Limits,
        shape: ErrorShape,
        name: str,
        handler_kwargs: dict[str, Any],
    ):
        super().__init__(runner, host, port, backlog=1024)
        self.limits, self.shape, self.listener = limits, shape, name
        self.admission = _Admission(limits, name)
        self.timed_out = 0
        self._handler_kwargs = handler_kwargs
        self._second, self._refused_this_second, self._paused = 0, 0, False

    def make_handler(self) -> _JsonErrorHandler:
        server = self._runner.server
        assert server is not None
        handler = _JsonErrorHandler(server, loop=asyncio.get_running_loop(), **self._handler_kwargs)
        handler.shape = self.shape  # type: ignore[assignment]
        return handler

    def refused(self, address: str, why: str) -> None:
        self.admission.refused += 1
        log.warning("refused a connection from %s: %s", address, why)
        second = int(time.monotonic())
        if second != self._second:
            self._second, self._refused_this_second = second, 0
        self._refused_this_second += 1
        if self._refused_this_second >= REFUSALS_PER_SECOND:
            self._pause(second + 1 - time.monotonic())

    def _pause(self, seconds: float) -> None:
        """Stop accepting for the rest of this second: the kernel's backlog holds what comes
        meanwhile, at no cost to this process. Each refusal costs an accept, a transport and a
        write; a flood of thousands a second would take the event loop from the cluster's own
        traffic. (asyncio pauses a listener the same way when accept() fails with EMFILE.)"""
        loop = asyncio.get_running_loop()
        server = self._server
        sockets = getattr(server, "_sockets", None)
        if self._paused or not sockets or not hasattr(loop, "_start_serving"):
            return  # another event loop (uvloop): refusals stay unthrottled
        self._paused = True
        for sock in sockets:
            loop._remove_reader(sock.fileno())  # type: ignore[attr-defined]
        loop.call_later(max(0.05, seconds), self._resume, sockets)

    def _resume(self, sockets: list[Any]) -> None:
        self._paused = False
        if self._server is None or not self._server.is_serving():  # type: ignore[union-attr]
            return
        loop = asyncio.get_running_loop()
        for sock in sockets:
            loop._start_serving(  # type: ignore[attr-defined]
                self._factory, sock, None, self._server, self._backlog
            )

    async def start(self) -> None:
        await web.BaseSite.start(self)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._factory,
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
        )

    def _factory(self) -> _Guard:
        return _Guard(self)

    def stats(self) -> ListenerStats:
        return ListenerStats(
            open=self.admission.total, refused=self.admission.refused, head_timeouts=self.timed_out
        )


def body_deadline(
    timeout: float, too_large: Callable[[], Exception] | None = None
) -> Callable[..., Awaitable[web.StreamResponse]]:
    """Middleware: read the whole body (aiohttp keeps it for the handler's own ``read()``)
    within ``timeout`` seconds, or answer 408. ``too_large`` makes the error for a body over
    the app's ``client_max_size``."""

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.can_read_body:
            try:
                # wait_for, not asyncio.timeout: Python 3.10 has no asyncio.timeout
                await asyncio.wait_for(request.read(), timeout if timeout > 0 else None)
            except asyncio.TimeoutError:  # TimeoutError from 3.11 on; its own class on 3.10
                raise web.HTTPRequestTimeout(
                    reason=f"the request body did not arrive within {timeout:g} s"
                ) from None
            except web.HTTPRequestEntityTooLarge:
                if too_large is None:
                    raise
                raise too_large() from None
        return await handler(request)

    return middleware


async def serve(
    app: web.Application,
    host: str,
    port: int,
    limits: Limits,
    shape: ErrorShape,
    name: str,
    **runner_kwargs: Any,
) -> tuple[web.AppRunner, LimitedSite]:
    """Start ``app`` on a `LimitedSite`. The app should carry `body_deadline` (outermost
    after its error middleware) so that its body reads are bounded too."""
    handler_kwargs: dict[str, Any] = {
        "access_log": None,
        "keepalive_timeout": limits.keepalive_timeout,
        "max_field_size": limits.max_field_size,
        "max_line_size": limits.max_line_size,
        "lingering_time": limits.lingering_time,
    }
    runner = web.AppRunner(app, **handler_kwargs, **runner_kwargs)
    await runner.setup()
    site = LimitedSite(runner, host, port, limits, shape, name, handler_kwargs)
    await site.start()
    return runner, site
