"""Errors in the shape of the API that was called.

OpenAI: `{"error": {message, type, param, code}}`; Anthropic (`/v1/messages`):
`{"type": "error", "error": {type, message}}`. A 5xx message never carries exception text: the
server logs the details under the request's id and the client is told where to look.
"""

from __future__ import annotations

from typing import Any

ANTHROPIC_PATHS = ("/v1/messages",)

_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}
_OPENAI_ERROR_TYPES = {401: "authentication_error", 403: "permission_error",
                       404: "not_found_error", 408: "timeout_error"}


class APIError(Exception):
    """An error the client caused (4xx) or the server hit (5xx), rendered in the API's shape."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def openai_body(self) -> dict[str, Any]:
        kind = _OPENAI_ERROR_TYPES.get(self.status, "invalid_request_error")
        if self.status >= 500:
            kind = "server_error"
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }

    def anthropic_body(self) -> dict[str, Any]:
        kind = _ANTHROPIC_ERROR_TYPES.get(self.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def body_for(self, path: str) -> dict[str, Any]:
        return self.anthropic_body() if is_anthropic(path) else self.openai_body()


def is_anthropic(path: str) -> bool:
    return path.rstrip("/") in ANTHROPIC_PATHS


def short(value: Any, limit: int = 80) -> str:
    """repr of a client's value for an error message, cut so a message stays a line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def internal_error(request_id: str | None, what: str = "handling this request") -> APIError:
    """A 500 that says what failed and where the details are, without exception text."""
    where = f" (request id {request_id})" if request_id else ""
    return APIError(500, f"the server failed while {what}{where}; the error is in the server "
                    "log. Other requests are not affected.", code="internal_error")
