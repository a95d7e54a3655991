"""The HTTP app: OpenAI and Anthropic APIs, health and Prometheus metrics (FastAPI).

`create_app(engine, tokenizer, model_name, ...)` builds the app around any engine with the
`EngineProtocol` shape. Every error is JSON in the shape of the API that was called (errors.py).
Before a route runs, `RequestGuard` (guard.py) has checked the origin, the API key and the body
(JSON, size, time); it also counts every response by status. A client that disconnects,
streaming or not, has its engine request aborted. Request bodies are parsed, and prompts rendered
and tokenized, in worker threads, so one large request never stalls `/health` or other streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from model.serve.engine.generation import EngineProtocol
from model.serve.http import anthropic_api, openai_api
from model.serve.http.errors import APIError
from model.serve.http.guard import RequestGuard
from model.serve.http.limits import HTTPLimits
from model.serve.http.metrics import CONTENT_TYPE, ServerMetrics
from model.serve.http.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    MessagesRequest,
    parse_body,
)
from model.serve.http.serving import ServeContext
from model.serve.http.sse import SSEResponse
from model.serve.tokenizer import BeamTokenizer

__all__ = ["EngineProtocol", "HTTPLimits", "ServeContext", "create_app"]

log = logging.getLogger(__name__)
ROUTES = ("/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions",
          "/v1/messages")


async def _call(result: Any) -> None:
    if inspect.isawaitable(result):
        await result


async def _wait_disconnect(request: Request) -> None:
    # The body is read already, so the next ASGI message is the disconnect (if it comes).
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _respond(request: Request, work: Coroutine[Any, Any, Any]) -> Response:
    """Run a handler, cancelling it (and so aborting its engine request) if the client leaves
    before the answer or the stream's first event is ready; streams watch on their own after."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
    result = task.result()
    return JSONResponse(result) if isinstance(result, dict) else SSEResponse(result)


def health_body(engine: Any) -> tuple[int, dict[str, str]]:
    if getattr(engine, "is_running", True) is not False:
        return 200, {"status": "ok"}
    error = getattr(engine, "error", None)
    kind = f" ({type(error).__name__})" if error is not None else ""
    return 503, {"status": "unhealthy",
                 "reason": f"the engine has stopped on an internal error{kind}; the server is "
                           "shutting down so that a supervisor restarts it (details in its log)"}


def create_app(
    engine: EngineProtocol,
    tokenizer: BeamTokenizer,
    model_name: str,
    api_key: str | None = None,
    max_model_len: int = 4096,
    manage_engine: bool = True,
    allowed_origins: tuple[str, ...] = (),
    limits: HTTPLimits | None = None,
) -> FastAPI:
    """The server app. With `manage_engine`, app start-up/shut-down start and stop the engine."""
    metrics = ServerMetrics(model_name, engine)
    ctx = ServeContext(engine, tokenizer, model_name, max_model_len, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_engine and hasattr(engine, "start"):
            await _call(engine.start())
        try:
            yield
        finally:
            if manage_engine and hasattr(engine, "shutdown"):
                await _call(engine.shutdown())

    app = FastAPI(title="autoopt Beam server", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.ctx = ctx
    _add_error_handlers(app)
    _add_routes(app, ctx)
    app.add_middleware(RequestGuard, metrics=metrics, api_key=api_key,
                       allowed_origins=tuple(allowed_origins), limits=limits, handlers=ROUTES)
    if allowed_origins:  # outside the guard: answers the preflights of allowed origins
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins),
                           allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"])
    return app


def _add_routes(app: FastAPI, ctx: ServeContext) -> None:
    engine, name = ctx.engine, ctx.model_name

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = health_body(engine)
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE)

    # One entry readable by both SDKs: OpenAI's fields plus Anthropic's (type, display_name...).
    card = {"id": name, "object": "model", "created": ctx.created, "owned_by": "autoopt",
            "max_model_len": ctx.max_model_len, "type": "model", "display_name": name,
            "created_at": datetime.fromtimestamp(ctx.created, UTC).isoformat()}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [card], "has_more": False, "first_id": name,
                "last_id": name}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        ctx.check_model(model)
        return card

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req = await asyncio.to_thread(parse_body, ChatCompletionRequest, await request.body())
        return await _respond(request, openai_api.chat_completions(ctx, req))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await asyncio.to_thread(parse_body, CompletionRequest, await request.body())
        return await _respond(request, openai_api.completions(ctx, req))

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        req = await asyncio.to_thread(parse_body, MessagesRequest, await request.body())
        return await _respond(request, anthropic_api.messages(ctx, req))


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body_for(request.url.path), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            detail = f"no route {request.method} {request.url.path}; see /v1/models"
        elif exc.status_code == 405:
            detail = f"{request.method} is not allowed on {request.url.path}"
        err = APIError(exc.status_code, detail)
        return JSONResponse(err.body_for(request.url.path), status_code=err.status)
