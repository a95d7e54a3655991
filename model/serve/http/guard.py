"""What every request passes before the app sees it: the web's rules for a local server.

- Origin: a request that carries an `Origin` header (a web page's fetch, form or image) is
  refused with 403 unless that origin was allowed (`--allowed-origins`, `*` for any). Without
  this any page a user opens could drive a server on localhost; browsers send `Origin` on every
  POST, also same-origin ones after a DNS rebinding. Allowed origins get CORS headers and
  preflight answers from Starlette's CORSMiddleware.
- Auth: with an API key, `/v1/*` needs `Authorization: Bearer KEY` or `x-api-key: KEY`;
  `/health` and `/metrics` stay open for load balancers and scrapers, as in vLLM.
- POST bodies must be JSON (`Content-Type: application/json`, 415 otherwise: a text/plain body is
  how a page sends a request without a CORS preflight), at most `max_request_bytes` (413, checked
  on Content-Length before reading and again while reading) and complete within
  `body_timeout_s` (408). The body is read here and replayed to the app.
- A client that goes away before its answer is counted as status 499, logged at INFO, and is
  never a server error. An unexpected error is logged once, with its traceback, and answered with
  a 500 in the API's shape that carries no exception text.
- Every response is counted in `http_requests_total{handler, method, status}`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from model.serve.http.errors import APIError, internal_error, short
from model.serve.http.limits import HTTPLimits
from model.serve.http.metrics import ServerMetrics

log = logging.getLogger(__name__)
CLIENT_CLOSED = 499  # nginx's "client closed request"


class _ClientGone(Exception):
    pass


def normalize_origin(origin: str) -> str:
    return origin.strip().rstrip("/").lower()


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


class RequestGuard:
    """Pure ASGI middleware (outermost): origin, auth, body rules, status counts."""

    def __init__(self, app: ASGIApp, *, metrics: ServerMetrics, api_key: str | None = None,
                 allowed_origins: tuple[str, ...] = (), limits: HTTPLimits | None = None,
                 handlers: tuple[str, ...] = ()) -> None:
        self.app = app
        self.metrics = metrics
        self.api_key = api_key
        self.allowed = frozenset(normalize_origin(o) for o in allowed_origins)
        self.limits = limits or HTTPLimits()
        self.handlers = frozenset(handlers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope["path"], scope["method"]
        status: list[int] = []

        async def observed(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                await self._reply(refusal, scope, observed, close=method == "POST")
                return
            if method == "POST":
                receive = _replay(await self._read_body(scope, receive), receive)
            await self.app(scope, receive, observed)
        except _ClientGone:
            log.info("client %s went away while sending %s %s", scope.get("client"), method, path)
        except APIError as err:
            await self._reply(err, scope, observed, close=True)
        except Exception as exc:
            if status:  # answered already (a stream that broke off): nothing left to tell
                log.debug("%s %s ended with %r after its answer began", method, path, exc)
                return
            log.error("unhandled error on %s %s", method, path, exc_info=exc)
            await self._reply(internal_error(None), scope, observed, close=False)
        finally:
            self.metrics.response(self._handler(path), method,
                                  status[0] if status else CLIENT_CLOSED)

    def _handler(self, path: str) -> str:
        if path in self.handlers:
            return path
        if path.startswith("/v1/models/"):
            return "/v1/models/{name}"
        return "other"  # unknown paths share one label: clients cannot grow the series

    # ---- checks ---------------------------------------------------------------------------
    def _refusal(self, scope: Scope) -> APIError | None:
        origin = _header(scope, b"origin")
        if origin is not None and "*" not in self.allowed \
                and normalize_origin(origin) not in self.allowed:
            allowed = ", ".join(sorted(self.allowed)) or "none"
            return APIError(403, f"cross-origin request from {short(origin)} refused: this server "
                            f"answers only the origins it was started with (--allowed-origins; "
                            f"allowed: {allowed})", code="origin_not_allowed")
        method = scope["method"]
        if method == "OPTIONS":
            return None  # a preflight from an allowed origin: CORSMiddleware answers it
        if scope["path"].startswith("/v1/") and not self._authorized(scope):
            return APIError(401, "invalid or missing API key: send 'Authorization: Bearer KEY' "
                            "or 'x-api-key: KEY' with the key the server was started with",
                            code="invalid_api_key")
        if method == "POST":
            return self._body_refusal(scope)
        return None

    def _authorized(self, scope: Scope) -> bool:
        if self.api_key is None:
            return True
        auth = _header(scope, b"authorization") or ""
        given = auth[7:].strip() if auth.lower().startswith("bearer ") else None
        given = given if given is not None else _header(scope, b"x-api-key")
        return given is not None and hmac.compare_digest(given.encode(), self.api_key.encode())

    def _body_refusal(self, scope: Scope) -> APIError | None:
        kind = (_header(scope, b"content-type") or "").split(";")[0].strip().lower()
        if kind != "application/json":
            return APIError(415, f"the request body must be JSON sent with 'Content-Type: "
                            f"application/json', got {short(kind) if kind else 'no content type'}",
                            code="unsupported_media_type")
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limits.max_request_bytes:
            return self._too_large(int(length))
        return None

    def _too_large(self, size: int) -> APIError:
        return APIError(413, f"the request body is {size} bytes or more; this server takes at "
                        f"most {self.limits.max_request_bytes} (--max-request-bytes)",
                        code="request_too_large")

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.limits.body_timeout_s
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except TimeoutError:
                raise APIError(408, f"the request body did not arrive within "
                               f"{self.limits.body_timeout_s:g} s; send the whole body at once",
                               code="body_timeout") from None
            if message["type"] == "http.disconnect":
                raise _ClientGone
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limits.max_request_bytes:
                raise self._too_large(size)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _reply(self, err: APIError, scope: Scope, send: Send, close: bool) -> None:
        # close: the client may still be sending a body this server will not read.
        headers = {"connection": "close"} if close else None
        response = JSONResponse(err.body_for(scope["path"]), status_code=err.status,
                                headers=headers)
        await response(scope, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body already read, then whatever the client sends next (its disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
