"""Server-sent events: the wire format, the response that carries them, and in-band errors."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from model.serve.http.errors import APIError, internal_error

log = logging.getLogger(__name__)


def sse(data: dict[str, Any] | str, event: str | None = None) -> str:
    body = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return (f"event: {event}\n" if event else "") + f"data: {body}\n\n"


def stream_error(exc: Exception, request_id: str) -> APIError:
    """The in-band error event of a stream that has begun (its status line is sent already)."""
    if isinstance(exc, APIError):
        return exc  # a request's own failure, logged where it happened
    log.error("stream %s failed", request_id, exc_info=exc)
    return internal_error(request_id, "streaming the response")


class SSEResponse(StreamingResponse):
    """A stream that always closes its iterator, so a client that leaves aborts its request."""

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
