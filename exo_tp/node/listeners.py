"""A node's two HTTP listeners, each with its own limits (`exo_tp.api.server_limits`).

- the public API (``--api-port``): anyone who can reach it; its connection cap leaves most of
  the process's file descriptors to everything else;
- the cluster listener (``--control-port``, announced over mDNS): control, status polls,
  weight transfer, and generation requests members pass on to the leader (under
  `FORWARD_PREFIX`, signed with the cluster secret). Public clients never share its
  connection budget, so no number of API connections can fail an epoch, drop a node from the
  plan or move the leadership. A request without the signature headers is refused before its
  body is read.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from exo_tp.api.core.errors import FORWARD_PREFIX, error_shape
from exo_tp.api.server_limits import (
    LimitedSite,
    Limits,
    ListenerStats,
    body_deadline,
    plain_shape,
    raise_fd_limit,
    serve,
)
from exo_tp.wire.http import refuse

log = logging.getLogger(__name__)

SIGNATURE_HEADERS = ("X-Exo-Tp-Time", "X-Exo-Tp-Signature")


@web.middleware
async def _signature_headers_first(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """An anonymous request is refused from its head alone: its body is never waited for."""
    if not all(h in request.headers for h in SIGNATURE_HEADERS):
        return refuse(401, "bad or missing signature")
    return await handler(request)


def guard_cluster_app(app: web.Application, limits: Limits) -> None:
    """Before the control app's own middlewares: the signature headers, then the body
    within ``limits.body_timeout``."""
    app.middlewares[:0] = [_signature_headers_first, body_deadline(limits.body_timeout)]


def mount_forwarded_api(control: web.Application, api: web.Application) -> None:
    """The public API's routes on the cluster listener, for requests members pass on."""
    control.add_subapp(FORWARD_PREFIX, api)


class Listeners:
    """The node's listeners: their sites (for their counts), and cleanup."""

    def __init__(self) -> None:
        self.runners: list[web.AppRunner] = []
        self.sites: dict[str, LimitedSite] = {}
        soft, hard = raise_fd_limit()
        log.debug("open files limit: %d (hard %d)", soft, hard)

    async def serve_api(
        self, app: web.Application, host: str, port: int, limits: Limits, **kwargs: Any
    ) -> int:
        return await self._serve("API", app, host, port, limits, error_shape, **kwargs)

    async def serve_cluster(
        self, app: web.Application, host: str, port: int, limits: Limits
    ) -> int:
        return await self._serve("cluster", app, host, port, limits, plain_shape)

    async def _serve(
        self,
        name: str,
        app: web.Application,
        host: str,
        port: int,
        limits: Limits,
        shape: Any,
        **kwargs: Any,
    ) -> int:
        runner, site = await serve(app, host, port, limits, shape, name, **kwargs)
        self.runners.append(runner)
        self.sites[name] = site
        return runner.addresses[0][1]

    def view(self) -> dict[str, ListenerStats]:
        """Open connections, refusals and head timeouts per listener (for /health)."""
        return {name: site.stats() for name, site in self.sites.items()}

    async def close(self) -> None:
        for runner in self.runners:
            await runner.cleanup()
