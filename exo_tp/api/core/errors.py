"""The API's errors: OpenAI-style JSON bodies with an HTTP status (or Anthropic's shape on the
Messages API)."""

from __future__ import annotations

from typing import Any

ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
# Members pass generation requests to the leader over its cluster listener, under this prefix
# (signed with the cluster secret), never through its public API: see exo_tp.api.server_limits.
FORWARD_PREFIX = "/cluster-api"

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    503: "overloaded_error",
}


_OPENAI_TYPES = {429: "requests"}


class ApiError(Exception):
    """An error the API returns as OpenAI-style JSON with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str | None = None,
        retry_after: int | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        # Unless given: OpenAI's convention, a 5xx is the server's failure, a 429 a rate limit
        # ("requests": its type for a requests-per-minute limit) and anything else the
        # request's (clients read the type to tell which).
        self.kind = kind or (
            "server_error" if status >= 500 else _OPENAI_TYPES.get(status, "invalid_request_error")
        )
        self.retry_after = retry_after  # seconds, sent as the Retry-After header

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict[str, Any]:
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def not_ready(reason: str) -> ApiError:
    """The 503 a client gets while the cluster cannot serve yet (retry in a few seconds)."""
    return ApiError(
        503,
        f"cluster not ready: {reason}",
        kind="server_error",
        code="cluster_not_ready",
        retry_after=5,
    )


def api_path(path: str) -> str:
    """The public API path of a request, also when a member passed it on to the leader."""
    return path[len(FORWARD_PREFIX) :] if path.startswith(FORWARD_PREFIX + "/") else path


def shaped_body(path: str, error: ApiError) -> dict[str, Any]:
    """The error's body in the shape of the route it answers: Anthropic's on the Messages
    API, OpenAI's everywhere else."""
    return error.anthropic_body() if api_path(path) in ANTHROPIC_PATHS else error.body()


def error_shape(path: str, status: int, message: str) -> dict[str, Any]:
    """A body for an error raised below the routes (the HTTP layer, a connection cap)."""
    codes = {
        400: "bad_request",
        408: "request_timeout",
        413: "request_too_large",
        429: "too_many_connections",
        431: "request_header_too_large",
        503: "too_many_connections",
    }
    return shaped_body(path, ApiError(status, message, code=codes.get(status)))
