"""One log line per refused request (a 4xx or 5xx answer), so that an operator sees why a
client fails against the cluster: the route, the status, the client's address and user agent,
the field the error names and its message. The log's flood limits apply (exo_tp.log_flood):
the route and status are part of the line's template, so each kind is shown a few times a
minute and the rest counted, whatever a client sends."""

from __future__ import annotations

import logging

from aiohttp import web

from exo_tp.api.core.errors import FORWARD_PREFIX, ApiError, api_path

log = logging.getLogger("exo_tp.api.refused")

REFUSAL = web.RequestKey("refusal", ApiError)  # the error a route or guard answered with
PASSED_ON = web.RequestKey("passed_on", str)  # the leader answered it (and logged it)
# The member that passed a request on names its client (on the signed cluster listener only)
CLIENT_HEADER = "X-Exo-Tp-Client"
MAX_SHOWN = 200  # characters of a message, a user agent or a path in the line


def client_of(request: web.Request) -> str:
    """The client's address: the one a member passed the request on for, else the peer's."""
    if request.path.startswith(FORWARD_PREFIX + "/"):
        passed = request.headers.get(CLIENT_HEADER)
        if passed:
            return passed[:64]
    return request.remote or "?"


async def log_refusal(request: web.Request, response: web.StreamResponse) -> None:
    """An `on_response_prepare` hook: the line for a refused request. A request passed on to
    the leader is logged there, with its client's address, not again here."""
    if response.status < 400 or PASSED_ON in request:
        return
    route = request.match_info.route.resource
    # the public API's names, also for a request a member passed on to the leader
    name = api_path(route.canonical) if route is not None else "(no such route)"
    error = request.get(REFUSAL)
    message = error.message if error is not None else (response.reason or "")
    param = error.param if error is not None and error.param else "-"
    agent = request.headers.get("User-Agent", "-")
    log.warning(
        # the route and status in the template: the flood filter limits each kind apart
        f"refused {request.method} {name} with {response.status}: %s (field %s; client %s; "
        "user-agent %s; path %s)",
        message[:MAX_SHOWN],
        param,
        client_of(request),
        agent[:MAX_SHOWN],
        api_path(request.path)[:MAX_SHOWN],
    )
