"""`autoopt review serve`: bind, print the URL with its token, serve until Ctrl-C.

The socket is bound before the app is made, so the Host check knows the real port (`--port 0`
takes a free one). Bound to loopback by default; any other address is served only when asked
for, with a loud warning: whoever can reach it and holds the token can accept kernels that the
serving runtime will then load.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import FastAPI

from model.registry import Registry

from .app import create_app
from .runs import Runs
from .security import Guard, allowed_hosts, is_loopback

DEFAULT_PORT = 8765


def bind(host: str, port: int) -> socket.socket:
    """A bound TCP socket for (host, port); port 0 takes a free one."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} ({exc.strerror}); pass another --port "
                      "(0 takes a free one)") from None
    return sock


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


@dataclass(frozen=True)
class Served:
    app: FastAPI
    sock: socket.socket
    url: str  # with ?token=...
    base: str  # without it
    token: str


def prepare(reg: Registry, runs: Runs, host: str = "127.0.0.1", port: int = DEFAULT_PORT,
            token: str | None = None) -> Served:
    sock = bind(host, port)
    real_port = sock.getsockname()[1]
    token = token or Guard.new_token()
    app = create_app(reg, runs, Guard(token, allowed_hosts(host, real_port)))
    base = f"http://{url_host(host)}:{real_port}"
    return Served(app, sock, f"{base}/?token={token}", base, token)


def _server(served: Served) -> uvicorn.Server:
    config = uvicorn.Config(served.app, log_level="warning", access_log=False, lifespan="off")
    return uvicorn.Server(config)


def run(served: Served) -> None:
    """Serve in this thread until interrupted."""
    _server(served).run(sockets=[served.sock])


@contextmanager
def in_thread(served: Served, timeout_s: float = 20.0) -> Iterator[Served]:
    """Serve from a background thread while the block runs (tests, screenshots)."""
    server = _server(served)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [served.sock]},
                              daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the review server did not start")
        time.sleep(0.02)
    try:
        yield served
    finally:
        server.should_exit = True
        thread.join(timeout_s)
        served.sock.close()


def banner(served: Served, reg: Registry, runs_dir: Path, host: str
           ) -> tuple[list[str], list[str]]:
    """(warnings, lines) printed at start-up."""
    warnings = [] if is_loopback(host) else [
        f"WARNING: listening on {host}, not loopback: anyone who can reach this machine and "
        f"holds the token below can accept, reject and lock kernels in {reg.root}. Use the "
        "default --host 127.0.0.1 (and an SSH tunnel) unless you mean it; the Host header is "
        "not checked on a non-loopback address."]
    lines = [f"autoopt review: registry {reg.root}, runs {runs_dir}",
             "Open this URL (the token is needed once; the browser keeps it in a cookie):",
             f"    {served.url}", "Ctrl-C stops the server."]
    return warnings, lines


def serve(reg: Registry, runs_dir: Path, host: str, port: int,
          say: Callable[[str], None], warn: Callable[[str], None]) -> None:
    served = prepare(reg, Runs(runs_dir), host, port)
    warnings, lines = banner(served, reg, runs_dir, host)
    for w in warnings:
        warn(w)
    for line in lines:
        say(line)
    run(served)
