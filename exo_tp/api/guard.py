"""Middlewares guarding the public API: CORS, the API key, and JSON-only bodies.

Order (outermost first, after `exo_tp.api.routes.json_errors`): a CORS preflight is answered
before anything else (browsers send it without credentials); then the API key; then the body's
content type. CORS headers are added to every response as it is prepared, streams and errors
included, so a page on an allowed origin can read a 401 or a 415 too.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from typing import Any

from aiohttp import web

from exo_tp.api.core.errors import ApiError, api_path, shaped_body
from exo_tp.api.core.refusals import REFUSAL
from exo_tp.security.access import ANY_ORIGIN, ApiAccess

# Routes anyone may read: liveness, and the UI's page and files (the page asks for the key).
OPEN_ROUTES = {"/health", "/", "/ui/{name}"}
BODY_METHODS = {"POST", "PUT", "PATCH"}
UPLOAD_PATHS = ("/v1/files",)
ALLOWED_METHODS = "GET, POST, OPTIONS"
# Headers a browser client may send: auth, JSON, and the official SDKs' own. Authorization has
# to be named: a wildcard never covers it.
ALLOWED_HEADERS = (
    "authorization",
    "x-api-key",
    "content-type",
    "x-request-id",
    "anthropic-version",
    "anthropic-beta",
    "anthropic-dangerous-direct-browser-access",
    "openai-organization",
    "openai-project",
    "openai-beta",
)
SDK_HEADER = re.compile(r"x-stainless-[a-z0-9-]+")  # openai/anthropic SDKs' telemetry headers
PREFLIGHT_MAX_AGE = "600"


def _route_of(request: web.Request) -> str | None:
    """The matched route's pattern (never the raw path, which encodings can disguise); None
    when no route matched the path or the method."""
    if request.match_info.http_exception is not None:
        return None
    return request.match_info.route.resource.canonical  # type: ignore[union-attr]


def _no_such_path(request: web.Request) -> bool:
    error = request.match_info.http_exception
    return error is not None and error.status == 404


def _allow_origin(access: ApiAccess, origin: str) -> str:
    return ANY_ORIGIN if ANY_ORIGIN in access.allowed_origins else origin


def _requested_headers(request: web.Request) -> list[str]:
    asked = request.headers.get("Access-Control-Request-Headers", "")
    return [h.strip().lower() for h in asked.split(",") if h.strip()]


def cors_preflight(access: ApiAccess) -> Any:
    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.method != "OPTIONS" or _no_such_path(request):
            return await handler(request)
        origin = request.headers.get("Origin")
        if origin is None or "Access-Control-Request-Method" not in request.headers:
            return web.Response(status=204, headers={"Allow": ALLOWED_METHODS})
        if not access.origin_allowed(origin):
            raise ApiError(
                403,
                f"origin {origin[:200]} is not allowed to call this API (the "
                f"node's --allowed-origins)",
                code="origin_not_allowed",
            )
        sdk = [h for h in _requested_headers(request) if SDK_HEADER.fullmatch(h)]
        return web.Response(
            status=204,
            headers={
                "Access-Control-Allow-Origin": _allow_origin(access, origin),
                "Access-Control-Allow-Methods": ALLOWED_METHODS,
                "Access-Control-Allow-Headers": ", ".join([*ALLOWED_HEADERS, *sdk]),
                "Access-Control-Max-Age": PREFLIGHT_MAX_AGE,
                "Vary": "Origin",
            },
        )

    return middleware


def cors_headers(access: ApiAccess) -> Any:
    """on_response_prepare: let an allowed origin's page read the response."""

    async def add(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin is None or "Access-Control-Allow-Origin" in response.headers:
            return
        response.headers.add("Vary", "Origin")
        if access.origin_allowed(origin):
            response.headers["Access-Control-Allow-Origin"] = _allow_origin(access, origin)
            response.headers["Access-Control-Expose-Headers"] = "x-request-id"

    return add


def _presented_key(request: web.Request) -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key")


def _digest(text: str) -> bytes:
    # equal-length digests: the comparison's time says nothing about the key, not even its length
    return hashlib.sha256(text.encode()).digest()


def require_api_key(access: ApiAccess) -> Any:
    expected = _digest(access.api_key.get_secret_value()) if access.api_key else None

    @web.middleware
    async def middleware(request: web.Request, handler: Any) -> web.StreamResponse:
        if expected is None or request.method == "OPTIONS" or _route_of(request) in OPEN_ROUTES:
            return await handler(request)
        presented = _presented_key(request)
        if presented is not None and hmac.compare_digest(_digest(presented), expected):
            return await handler(request)
        message = (
            "Incorrect API key provided."
            if presented is not None
            else "You didn't provide an API key."
        )
        error = ApiError(
            401,
            f"{message} This node requires one: send it as 'Authorization: "
            f"Bearer KEY' (OpenAI clients' api_key) or 'x-api-key: KEY'.",
            code="invalid_api_key",
        )
        request[REFUSAL] = error  # for the refusal's log line
        # Anthropic's shape on its routes: its SDK raises AuthenticationError from it
        return web.json_response(
            shaped_body(request.path, error),
            status=401,
            headers={"WWW-Authenticate": 'Bearer realm="exo-tp"'},
        )

    return middleware


def _file_upload(request: web.Request) -> bool:
    """OpenAI's file upload is multipart; accepted from clients that are no browser page
    (a browser names the page's Origin on every cross-site POST)."""
    return (
        api_path(request.path) in UPLOAD_PATHS
        and request.content_type == "multipart/form-data"
        and "Origin" not in request.headers
    )


@web.middleware
async def json_bodies_only(request: web.Request, handler: Any) -> web.StreamResponse:
    """Bodies must be declared JSON: a cross-site form or text/plain post, which a browser
    sends without asking, never reaches an endpoint."""
    if (
        request.method in BODY_METHODS
        and _route_of(request) is not None
        and request.content_type != "application/json"
        and not _file_upload(request)
    ):
        sent = request.headers.get("Content-Type")
        raise ApiError(
            415,
            f"the request body must be JSON, sent with 'Content-Type: "
            f"application/json' (got {sent[:100] if sent else 'none'})",
            code="unsupported_media_type",
        )
    return await handler(request)


def install_guard(app: web.Application, access: ApiAccess) -> None:
    app.middlewares.extend([cors_preflight(access), require_api_key(access), json_bodies_only])
    app.on_response_prepare.append(cors_headers(access))
