"""Built-in tools a client offers that this cluster cannot run (web search, code execution,
computer use...). Agent CLIs send them with every request, so they are left out of what the
model sees rather than refused: the client still works, and the response says what was left
out (a log line and the `x-exo-tp-tools-left-out` header), so no one mistakes it for a model
that chose not to search."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from aiohttp import web

log = logging.getLogger(__name__)

TOOLS_LEFT_OUT = "x-exo-tp-tools-left-out"
_KEY = web.RequestKey("tools_left_out", str)  # the names, comma-separated


def leave_out(request: web.Request, names: Sequence[str]) -> None:
    """Record (and log) the tools of ``request`` that the model will not see."""
    if names:
        log.info(
            "%s: left out built-in tools this cluster cannot run: %s",
            request.path,
            ", ".join(names),
        )
        request[_KEY] = ",".join(names)


def tag(request: web.Request, response: web.StreamResponse) -> None:
    """Name the left-out tools on ``request``'s response (before its headers are sent)."""
    names = request.get(_KEY)
    if names and TOOLS_LEFT_OUT not in response.headers:
        response.headers[TOOLS_LEFT_OUT] = names
