"""`autoopt serve`: load the engine, build the app, run uvicorn (one process, or rank 0 of a
tensor-parallel group whose other ranks follow its steps).

Uvicorn runs with a deadline on each request's head (`HeadTimeoutH11Protocol`; the body's
deadline is the guard's) and a watcher that ends the server when the engine stops on a fatal
error: the process then exits with status 1 and a clear log line, so a supervisor restarts it.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import h11
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from model.serve.http.app import create_app
from model.serve.http.limits import HTTPLimits

log = logging.getLogger(__name__)
HEALTH_GRACE_S = 1.0  # how long /health reports a dead engine before the server exits


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
    tp: int | None = None  # tensor-parallel ranks (model/serve/engine/tp_worker.py)
    ep: int | None = None
    attention_backend: str | None = None  # model/serve/attention_backends.py
    registry: str | None = None  # registry DIR of the kernels and the lock
    demo_checkpoint: Path | None = None  # where the demo is written when `model` is None
    allowed_origins: tuple[str, ...] = ()  # web origins that may call the server ("*": any)
    limits: HTTPLimits = field(default_factory=HTTPLimits)
    batch_invariant: bool | None = None  # EngineConfig.batch_invariant


def model_path(opts: ServeOptions, say: Callable[[str], None] = print) -> Path:
    """--model, or the demo checkpoint (written on first use)."""
    from model.demo import ensure_demo_checkpoint

    if opts.model is not None:
        return Path(opts.model)
    if opts.demo_checkpoint is None:
        raise ValueError("no --model given and no demo checkpoint directory to write one to; "
                         "pass --model PATH")
    path = ensure_demo_checkpoint(opts.demo_checkpoint)
    say(f"no --model given: serving the tiny demo checkpoint (random weights) at {path}")
    return path


def engine_config(opts: ServeOptions, path: Path):
    """The EngineConfig of these flags (None flags take its defaults)."""
    from model.serve.engine import EngineConfig

    given = {name: getattr(opts, name) for name in (
        "device", "dtype", "kernels", "max_num_seqs", "max_model_len", "max_num_batched_tokens",
        "gpu_memory_utilization", "tp", "ep", "attention_backend", "registry", "batch_invariant")
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
                     max_model_len=engine.max_model_len, allowed_origins=opts.allowed_origins,
                     limits=opts.limits)
    say(engine.engine.startup_report)
    return app, engine


def serving_banner(opts: ServeOptions, app: FastAPI, engine: Any) -> str:
    url = f"http://{opts.host}:{opts.port}"
    return (f"serving {app.state.ctx.model_name!r} at {url}/v1 (OpenAI) and {url}/v1/messages "
            f"(Anthropic); KV capacity {engine.stats().kv_capacity_tokens} tokens; metrics at "
            f"{url}/metrics")


def run_server(opts: ServeOptions, say: Callable[[str], None] = print) -> None:
    if opts.tp is not None and opts.tp > 1:
        run_tp_server(opts, say)  # rank 0 serves; this process watches the ranks
        return
    app, engine = build_server(opts, say)
    say(serving_banner(opts, app, engine))
    serve_until_stopped(app, engine, opts)


def uvicorn_config(app: Any, host: str, port: int, limits: HTTPLimits, **kwargs: Any):
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, http=head_timeout_protocol(limits),
                          timeout_keep_alive=5, **kwargs)


def serve_until_stopped(app: FastAPI, engine: Any, opts: ServeOptions) -> None:
    """Run uvicorn until Ctrl-C/SIGTERM, or until the engine dies (then SystemExit(1))."""
    import uvicorn

    # Bounded shutdown: after an engine failure the process must exit even if a client lingers.
    server = uvicorn.Server(uvicorn_config(app, opts.host, opts.port, opts.limits,
                                           log_level="info", timeout_graceful_shutdown=10))
    threading.Thread(target=_stop_when_engine_dies, args=(engine, server), daemon=True,
                     name="engine-watch").start()
    server.run()
    if getattr(engine, "error", None) is not None:
        log.critical("the server stopped because its engine failed (%s); exiting with status 1 "
                     "so that a supervisor restarts it", type(engine.error).__name__)
        raise SystemExit(1)


def _stop_when_engine_dies(served: Any, server: Any) -> None:
    # A dead engine cannot serve again (and under TP leaves the workers mid-step): end the
    # server, after a moment in which /health reports why, instead of answering 503 forever.
    while not server.should_exit:
        if served.error is not None:
            time.sleep(HEALTH_GRACE_S)
            server.should_exit = True
            return
        time.sleep(0.2)


class HeadTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's head.

    uvicorn itself closes a connection idle after an answer (keep-alive), but any byte cancels
    that timer, so a client sending a header a byte at a time holds a connection for ever. Here
    a connection that has not sent a complete request head within `head_timeout_s` of opening
    (or of its previous answer) is closed.
    """

    head_timeout_s = 10.0

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a complete head arrived
            self._cancel_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._cancel_head_timer()
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _cancel_head_timer(self) -> None:
        timer = getattr(self, "_head_timer", None)
        if timer is not None:
            timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            log.info("closing a connection from %s that sent no complete request head within "
                     "%g s", self.client, self.head_timeout_s)
            self.transport.close()


def head_timeout_protocol(limits: HTTPLimits) -> type[HeadTimeoutH11Protocol]:
    return type("HeadTimeoutH11Protocol", (HeadTimeoutH11Protocol,),
                {"head_timeout_s": limits.header_timeout_s})


# ---- tensor parallel ------------------------------------------------------------------------
def run_tp_server(opts: ServeOptions, say: Callable[[str], None] = print) -> None:
    """`autoopt serve --tp N`: rank 0 serves, the others follow; this process watches them and
    ends the group when one dies (TPError) or on SIGTERM / Ctrl-C."""
    from model.parallel import _under_torchrun, launch
    from model.serve.engine.tp_worker import backend_for, check_layout

    path = model_path(opts, say)  # written here once, not by N ranks at the same time
    opts = replace(opts, model=path)
    config = engine_config(opts, path)
    check_layout(config)
    backend = backend_for(config)
    say(f"starting {config.tp} tensor-parallel ranks ({backend}); rank 0 serves the API")
    if _under_torchrun():
        launch(_serve_rank, config.tp, backend, args=(opts,))
        return
    try:
        with _terminate_raises():
            launch(_serve_rank, config.tp, backend, args=(opts,))
    except KeyboardInterrupt:
        say("stopped: the tensor-parallel ranks were terminated")


@contextlib.contextmanager
def _terminate_raises() -> Iterator[None]:
    # SIGTERM interrupts the watching loop like Ctrl-C, so launch's cleanup stops the ranks.
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _serve_rank(group, opts: ServeOptions) -> None:
    from model.serve.engine.tp_worker import follow_steps, start_rank

    # Ctrl-C reaches every process of the terminal's group: the launcher and uvicorn (rank 0)
    # stop the group, so the others must not die half-way through a collective.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    engine, control = start_rank(engine_config(opts, opts.model), group)
    if group.rank == 0:
        _serve(engine, opts)
    else:
        follow_steps(engine, control)


def _serve(engine, opts: ServeOptions) -> None:
    from model.serve.engine import AsyncEngine

    served = AsyncEngine(engine)
    app, _ = build_server(opts, _print, engine=served)
    _print(serving_banner(opts, app, served))
    try:
        serve_until_stopped(app, served, opts)
    except SystemExit:
        # The workers may be stuck mid-step: fail, and the launcher stops them.
        raise RuntimeError(f"rank 0's engine stopped on an error, so the server shut down: "
                           f"{served.error!r}") from None
    engine.runner.stop_workers()


def _print(line: str) -> None:
    print(line, flush=True)
