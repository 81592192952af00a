"""The API's errors: OpenAI-style JSON bodies with an HTTP status."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An error the API returns as OpenAI-style JSON with an HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error",
                 retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (
            status, message, param, code, kind)
        self.retry_after = retry_after  # seconds, sent as the Retry-After header

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}
