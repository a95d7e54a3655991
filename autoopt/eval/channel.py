"""The judge's handle on a worker process: start it, send requests, move tensors, stop it.

`Worker` starts `python -m autoopt.eval.worker` (optionally under a wrapper such as
compute-sanitizer) in its own session, in a private temporary directory, with credentials and
autoopt's variables stripped from its environment; on CPU with the Triton interpreter on and
one intra-op thread. The worker connects back over a Unix socket in that directory. Every
request has a deadline (the whole worker's budget bounds them all); a worker that misses it is
killed with its process group and the request raises `WorkerError("timeout ...")`. Tensors go
through a memfd arena (wire.py) that the judge owns; outputs are read back as private copies.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from autoopt.env import REPO_ROOT

from . import wire

_SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "CREDENTIAL")
_clock = time.monotonic
_TAIL = 4000


_SUN_PATH_MAX = 100  # sockaddr_un.sun_path is 108 bytes with its NUL; a margin

class WorkerError(RuntimeError):
    """The worker timed out, died or broke the protocol; `kind` says which."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def worker_env(device: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not any(w in k.upper() for w in _SECRET_WORDS) and not k.startswith("AUTOOPT_")
           and k != "MALLOC_PERTURB_"}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if not device.startswith("cuda"):
        env["TRITON_INTERPRET"] = "1"  # CPU tensors run Triton kernels only through it
        env["OMP_NUM_THREADS"] = "1"  # small shapes: intra-op threads only contend
    return env


class Worker:
    """One worker process. Use as a context manager; `close()` always kills what is left."""

    def __init__(self, device: str, *, budget_s: float, mem_limit_bytes: int | None = None,
                 wrapper: Sequence[str] = (), arena_bytes: int = 16 << 20,
                 env: dict[str, str] | None = None) -> None:
        self.device = device
        self.env = dict(env or {})  # set in the worker's environment on top of worker_env's
        self.budget_s = budget_s
        self.mem_limit_bytes = mem_limit_bytes
        self.wrapper = list(wrapper)
        self.arena_bytes = arena_bytes
        self.tmp = Path(tempfile.mkdtemp(prefix="autoopt-worker-"))
        if len(os.fsencode(self.tmp / "sock")) > _SUN_PATH_MAX:
            # An AF_UNIX name holds 107 bytes: a deep TMPDIR (CI runners, macOS) cannot hold the
            # socket, so the worker's directory moves to /tmp.
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = Path(tempfile.mkdtemp(prefix="autoopt-worker-", dir="/tmp"))
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.arena: wire.Arena | None = None
        self.deadline = 0.0
        self.requests = 0
        self.started_s = 0.0
        self.precision: dict | None = None

    # ---- lifecycle ----------------------------------------------------------------------------
    def __enter__(self) -> Worker:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def start(self) -> None:
        t0 = _clock()
        self.deadline = t0 + self.budget_s
        path = str(self.tmp / "sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        self._out = open(self.tmp / "stdout.txt", "wb")  # noqa: SIM115 - closed in close()
        self._err = open(self.tmp / "stderr.txt", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [*self.wrapper, sys.executable, "-m", "autoopt.eval.worker", path], cwd=self.tmp,
            env={**worker_env(self.device), **self.env}, stdout=self._out, stderr=self._err,
            stdin=subprocess.DEVNULL, start_new_session=True)
        self._limit()
        try:
            self.sock = self._accept(listener)
        finally:
            listener.close()
        from model.ops.precision import contract_flags

        # Candidates run at the contracts' GEMM precision, as served (model/ops/precision.py).
        hello = self.request({"cmd": "hello", "precision": contract_flags()})
        self.precision = hello.get("precision")
        self._new_arena(self.arena_bytes)
        self.started_s = _clock() - t0

    def _limit(self) -> None:
        import resource

        try:
            resource.prlimit(self.proc.pid, resource.RLIMIT_CORE, (0, 0))
            if self.mem_limit_bytes:
                lim = (self.mem_limit_bytes, self.mem_limit_bytes)
                resource.prlimit(self.proc.pid, resource.RLIMIT_AS, lim)
        except (OSError, ValueError):  # pragma: no cover - a platform without prlimit
            pass

    def _accept(self, listener: socket.socket) -> socket.socket:
        while True:
            listener.settimeout(0.2)
            try:
                conn, _ = listener.accept()
                return conn
            except TimeoutError:
                if self.proc.poll() is not None:
                    tail = self.stderr_tail()[-800:]
                    raise WorkerError("died", f"worker exited with code {self.proc.returncode} "
                                              f"before connecting: {tail}") from None
                if _clock() > self.deadline:
                    self.kill()
                    raise WorkerError("timeout", f"worker did not start within "
                                                 f"{self.budget_s:g} s") from None

    def close(self, clean: bool = False, wait_s: float = 10.0) -> None:
        """Stop the worker; `clean` lets it shut CUDA down normally (a wrapper's report)."""
        if self.sock is not None and self.proc is not None and self.proc.poll() is None:
            try:
                self.request({"cmd": "exit", "clean": clean}, timeout=wait_s)
                self.proc.wait(timeout=wait_s)
            except (WorkerError, subprocess.TimeoutExpired, OSError):
                pass
        self.kill()
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None
        for f in ("_out", "_err"):
            if hasattr(self, f):
                getattr(self, f).close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def kill(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # it leads its own session
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()

    def stderr_tail(self) -> str:
        try:
            return (self.tmp / "stderr.txt").read_bytes()[-_TAIL:].decode("utf-8", "replace")
        except OSError:
            return ""

    # ---- requests -----------------------------------------------------------------------------
    def request(self, msg: dict, *, timeout: float | None = None,
                fds: tuple[int, ...] = ()) -> dict:
        """Send one request and wait for its reply within the deadline."""
        if self.sock is None:
            raise WorkerError("died", "the worker is not running")
        left = self.deadline - _clock()
        wait = left if timeout is None else min(left, timeout)
        if wait <= 0:
            self.kill()
            raise WorkerError("timeout", f"timeout after {self.budget_s:g} s (the candidate hung "
                                         f"or was too slow; worker killed)")
        self.requests += 1
        try:
            self.sock.settimeout(wait)
            wire.send(self.sock, msg, fds)
            reply, _ = wire.recv(self.sock)
        except TimeoutError:
            self.kill()
            what = f"{self.budget_s:g} s" if timeout is None or left <= timeout else \
                f"{timeout:g} s for one request ({msg.get('cmd')})"
            raise WorkerError("timeout", f"timeout after {what} (the candidate hung or was "
                                         f"too slow; worker killed)") from None
        except (EOFError, ConnectionError, OSError) as e:
            code = self.proc.wait(timeout=30) if self.proc else None
            raise WorkerError("died", f"worker died during {msg.get('cmd')} (exit code {code}, "
                                      f"{type(e).__name__}); stderr: "
                                      f"{self.stderr_tail()[-600:]}") from None
        except wire.ProtocolError as e:
            self.kill()
            raise WorkerError("protocol", f"worker broke the protocol: {e}") from None
        return reply

    def rtt_s(self, n: int = 7) -> float:
        """Median round trip of an empty request (subtracted from timed requests)."""
        samples = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.request({"cmd": "ping"})
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    # ---- tensors ------------------------------------------------------------------------------
    def _new_arena(self, size: int) -> None:
        old = self.arena
        self.arena = wire.Arena(wire.aligned(size))
        self.request({"cmd": "arena", "size": self.arena.size}, fds=(self.arena.fd,))
        if old is not None:
            old.close()

    def ensure(self, nbytes: int) -> None:
        if nbytes > self.arena.size:
            self._new_arena(max(nbytes, 2 * self.arena.size))

    def pack(self, args: Sequence[Any]) -> list[dict]:
        """Write the tensor arguments into the arena; descriptions for a `put`/`write`."""
        need = sum(wire.aligned(a.numel() * a.element_size()) for a in args
                   if isinstance(a, torch.Tensor))
        self.ensure(need)
        out, off = [], 0
        for a in args:
            if isinstance(a, torch.Tensor):
                # Straight from the device into the arena: one copy, no host temporary (a MoE
                # rank's inputs are ~9 GiB a case).
                d = self.arena.write(a.detach(), off)
                out.append(d.to_json())
                off = wire.aligned(off + d.nbytes)
            else:
                out.append({"scalar": a})
        return out

    def unpack(self, descs: Any, expect: Sequence[dict]) -> list[torch.Tensor | None]:
        """Private copies of the tensors the worker wrote, checked against `expect`."""
        if not isinstance(descs, list):
            raise WorkerError("protocol", f"output descriptions are {type(descs).__name__}")
        out: list[torch.Tensor | None] = []
        for d, e in zip(descs, expect, strict=False):
            if d is None:
                out.append(None)
                continue
            desc = wire.TensorDesc.parse(d, self.arena.size)
            if desc.dtype != e["dtype"] or list(desc.shape) != list(e["shape"]):
                raise WorkerError("protocol", f"worker wrote {desc.dtype}{list(desc.shape)} "
                                              f"where {e['dtype']}{e['shape']} was asked")
            out.append(self.arena.read(desc))
        return out + [None] * (len(expect) - len(out))
