"""The HTTP server: OpenAI and Anthropic APIs, health and Prometheus metrics (FastAPI).

`create_app(engine, tokenizer, model_name, ...)` builds the app around any engine with the
`EngineProtocol` shape; `run_server(ServeOptions(...))` is `autoopt serve`. Every error is JSON in
the shape of the API that was called: OpenAI's `{"error": {message, type, param, code}}`, or
Anthropic's `{"type": "error", "error": {type, message}}` on `/v1/messages`. Auth (when an API key
is set) covers `/v1/*` and takes `Authorization: Bearer KEY` or `x-api-key: KEY` on every route;
`/health` and `/metrics` stay open for load balancers and scrapers, as in vLLM. A client that
disconnects, streaming or not, has its engine request aborted.

Layout: protocol.py (request models, errors, tool validation), serving.py (context, prompts,
limits, tool_choice), generation.py (engine driving: stop strings, reasoning budget, forced
headers), openai_api.py and anthropic_api.py (response shapes), metrics.py (Prometheus text).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import inspect
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from model.serve import anthropic_api, openai_api
from model.serve.generation import EngineProtocol
from model.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    MessagesRequest,
    parse_body,
)
from model.serve.serving import ServeContext
from model.serve.tokenizer import BeamTokenizer

__all__ = ["EngineProtocol", "ServeContext", "ServeOptions", "build_server", "create_app",
           "run_server"]

log = logging.getLogger(__name__)
ANTHROPIC_PATHS = ("/v1/messages",)


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


def _is_anthropic(request: Request) -> bool:
    return request.url.path.rstrip("/") in ANTHROPIC_PATHS


def error_response(request: Request, err: APIError) -> JSONResponse:
    body = err.anthropic_body() if _is_anthropic(request) else err.openai_body()
    return JSONResponse(body, status_code=err.status)


def _authorize(ctx: ServeContext, request: Request) -> None:
    if ctx.api_key is None:
        return
    auth = request.headers.get("authorization", "")
    given = auth[7:].strip() if auth.lower().startswith("bearer ") else None
    given = given if given is not None else request.headers.get("x-api-key")
    if given is None or not hmac.compare_digest(given.encode(), ctx.api_key.encode()):
        raise APIError(401, "invalid or missing API key: send 'Authorization: Bearer KEY' or "
                       "'x-api-key: KEY' with the key the server was started with",
                       code="invalid_api_key")


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


def create_app(
    engine: EngineProtocol,
    tokenizer: BeamTokenizer,
    model_name: str,
    api_key: str | None = None,
    max_model_len: int = 4096,
    manage_engine: bool = True,
) -> FastAPI:
    """The server app. With `manage_engine`, app start-up/shut-down start and stop the engine."""
    ctx = ServeContext(engine, tokenizer, model_name, max_model_len, api_key)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_engine and hasattr(engine, "start"):
            await _call(engine.start())
        try:
            yield
        finally:
            if manage_engine and hasattr(engine, "shutdown"):
                await _call(engine.shutdown())

    app = FastAPI(title="autoopt Beam server", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.ctx = ctx
    _add_error_handlers(app, ctx)

    @app.get("/health")
    async def health() -> JSONResponse:
        if getattr(engine, "is_running", True) is False:  # the engine thread died or stopped
            return JSONResponse({"status": "engine not running"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(ctx.metrics.render(engine.stats()),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    # One entry readable by both SDKs: OpenAI's fields plus Anthropic's (type, display_name...).
    card = {"id": model_name, "object": "model", "created": ctx.created, "owned_by": "autoopt",
            "max_model_len": max_model_len, "type": "model", "display_name": model_name,
            "created_at": datetime.fromtimestamp(ctx.created, UTC).isoformat()}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        _authorize(ctx, request)
        return {"object": "list", "data": [card], "has_more": False, "first_id": model_name,
                "last_id": model_name}

    @app.get("/v1/models/{name:path}")
    async def model(name: str, request: Request) -> dict[str, Any]:
        _authorize(ctx, request)
        ctx.check_model(name)
        return card

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        _authorize(ctx, request)
        req = parse_body(ChatCompletionRequest, await request.body())
        return await _respond(request, openai_api.chat_completions(ctx, req))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        _authorize(ctx, request)
        req = parse_body(CompletionRequest, await request.body())
        return await _respond(request, openai_api.completions(ctx, req))

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        _authorize(ctx, request)
        req = parse_body(MessagesRequest, await request.body())
        return await _respond(request, anthropic_api.messages(ctx, req))

    return app


def _add_error_handlers(app: FastAPI, ctx: ServeContext) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        ctx.metrics.error(exc.status)
        return error_response(request, exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        ctx.metrics.error(exc.status_code)
        detail = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404:
            detail = f"no route {request.method} {request.url.path}; see /v1/models"
        elif exc.status_code == 405:
            detail = f"{request.method} is not allowed on {request.url.path}"
        return error_response(request, APIError(exc.status_code, detail))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        ctx.metrics.error(500)
        return error_response(request, APIError(500, f"internal server error: {exc}"))


@dataclass(frozen=True)
class ServeOptions:
    """`autoopt serve` flags; None takes the EngineConfig default (defined once, there)."""

    model: Path | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    device: str | None = None
    dtype: str | None = None
    kernels: str | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float | None = None
    api_key: str | None = None
    served_model_name: str | None = None
    tp: int | None = None  # tensor-parallel ranks (model/serve/tp_worker.py)
    ep: int | None = None
    attention_backend: str | None = None  # model/serve/attention_backends.py
    registry: str | None = None  # registry DIR of the kernels and the lock


def model_path(opts: ServeOptions, say: Callable[[str], None] = print) -> Path:
    """--model, or the demo checkpoint (written on first use)."""
    from model.serve.offline import ensure_demo_checkpoint

    if opts.model is not None:
        return Path(opts.model)
    path = ensure_demo_checkpoint()
    say(f"no --model given: serving the tiny demo checkpoint (random weights) at {path}")
    return path


def engine_config(opts: ServeOptions, path: Path):
    """The EngineConfig of these flags (None flags take its defaults)."""
    from model.serve.engine import EngineConfig

    given = {name: getattr(opts, name) for name in (
        "device", "dtype", "kernels", "max_num_seqs", "max_model_len", "max_num_batched_tokens",
        "gpu_memory_utilization", "tp", "ep", "attention_backend", "registry")
        if getattr(opts, name) is not None}
    return EngineConfig(model=str(path), **given)


def build_server(opts: ServeOptions, say: Callable[[str], None] = print,
                 engine: Any = None) -> tuple[FastAPI, Any]:
    """Load the engine (unless one is given) and build the app (the engine starts with it)."""
    from model.serve.engine import AsyncEngine

    path = model_path(opts, say)
    if engine is None:
        engine = AsyncEngine.from_config(engine_config(opts, path))
    if engine.tokenizer is None:
        raise ValueError(f"{path} has no tokenizer.json: the chat APIs need the checkpoint's "
                         "tokenizer; add one (autoopt demo-checkpoint writes one)")
    name = opts.served_model_name or Path(path).name
    app = create_app(engine, engine.tokenizer, name, api_key=opts.api_key,
                     max_model_len=engine.max_model_len)
    say(engine.engine.startup_report)
    return app, engine


def serving_banner(opts: ServeOptions, app: FastAPI, engine: Any) -> str:
    url = f"http://{opts.host}:{opts.port}"
    return (f"serving {app.state.ctx.model_name!r} at {url}/v1 (OpenAI) and {url}/v1/messages "
            f"(Anthropic); KV capacity {engine.stats().kv_capacity_tokens} tokens; metrics at "
            f"{url}/metrics")


def run_server(opts: ServeOptions, say: Callable[[str], None] = print) -> None:
    import uvicorn

    if opts.tp is not None and opts.tp > 1:
        from model.serve.tp_worker import run_tp_server

        run_tp_server(opts, say)  # rank 0 serves; this process watches the ranks
        return
    app, engine = build_server(opts, say)
    say(serving_banner(opts, app, engine))
    uvicorn.run(app, host=opts.host, port=opts.port, log_level="info")
