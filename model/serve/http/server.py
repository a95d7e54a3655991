"""`autoopt serve`: load the engine, build the app, run uvicorn (one process, or rank 0 of a
tensor-parallel group whose other ranks follow its steps)."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from model.serve.http.app import create_app


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
    attention_backend: str | None = None  # auto | torch | flashinfer
    demo_checkpoint: Path | None = None  # where the demo is written when `model` is None


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
        "gpu_memory_utilization", "tp", "ep", "attention_backend")
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
        run_tp_server(opts, say)  # rank 0 serves; this process watches the ranks
        return
    app, engine = build_server(opts, say)
    say(serving_banner(opts, app, engine))
    uvicorn.run(app, host=opts.host, port=opts.port, log_level="info")


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
    import uvicorn

    from model.serve.engine import AsyncEngine

    served = AsyncEngine(engine)
    app, _ = build_server(opts, _print, engine=served)
    server = uvicorn.Server(uvicorn.Config(app, host=opts.host, port=opts.port,
                                           log_level="info"))
    threading.Thread(target=_stop_when_engine_dies, args=(served, server), daemon=True,
                     name="tp-engine-watch").start()
    _print(serving_banner(opts, app, served))
    server.run()
    if served.error is not None:
        # The workers may be stuck mid-step: fail, and the launcher stops them.
        raise RuntimeError(f"rank 0's engine stopped on an error, so the server shut down: "
                           f"{served.error!r}")
    engine.runner.stop_workers()


def _stop_when_engine_dies(served, server) -> None:
    # A dead engine thread leaves the workers mid-step: take the server (and the group) down
    # instead of answering 503 forever.
    while not server.should_exit:
        if served.error is not None:
            server.should_exit = True
            return
        time.sleep(0.5)


def _print(line: str) -> None:
    print(line, flush=True)
