"""`AsyncEngine`: the LLMEngine stepped on a background thread, streamed to asyncio callers.

The engine thread owns the LLMEngine: callers never touch it directly, they post `add`/`abort`
commands to a thread-safe queue that the thread drains before every step, so a request waits at
most one step to join the batch and the event loop never blocks on a running step. Outputs go
back to each request's asyncio.Queue through `call_soon_threadsafe`. Validation runs in the
caller, so a bad request raises `RequestError` before it is queued.

A request that fails inside the engine (engine/faults.py) ends its own stream with
`RequestFailedError`; any other error of the engine thread is fatal: it is logged once as such,
every waiting request gets `EngineDeadError`, and `is_running` turns False (the server's
`/health` says so and the server exits so that a supervisor restarts it).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from .outputs import EngineStats, RequestFailedError, RequestOutput
from .sampler import RequestError, SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an error; the server should report unhealthy."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    def __init__(self, engine) -> None:
        self.engine = engine  # an LLMEngine; only the engine thread calls its mutating methods
        self._commands: collections.deque = collections.deque()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    @classmethod
    def from_config(cls, config) -> AsyncEngine:
        from .llm_engine import LLMEngine

        return cls(LLMEngine(config))

    # ---- what the API reads -------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    def stats(self) -> EngineStats:
        return self.engine.stats()  # counters and lengths: a consistent-enough snapshot

    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise RequestError now for a request the engine would refuse."""
        self.engine.check_request(prompt_token_ids, params)

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="autoopt-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the thread; requests still streaming end with finish_reason "abort"."""
        if self._thread is None:
            return
        with self._lock:
            for rid in list(self._streams):
                self._commands.append(("abort", rid, None, None))
        self._wake.set()
        self._drain_then_stop()

    def _drain_then_stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)
        self._thread = None

    # ---- requests -----------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as the engine makes them; the last has `finished` set.
        Closing the iterator early (a client that went away) aborts the request."""
        self.check_request(prompt_token_ids, params)
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped on an error: {self.error!r}")
        if self._thread is None:
            raise EngineDeadError("the engine is not running; call start() first")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if request_id in self._streams:
                raise RequestError(f"request id {request_id!r} is already running")
            self._streams[request_id] = stream
            self._commands.append(("add", request_id, list(prompt_token_ids), params))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
                if not finished:
                    self._commands.append(("abort", request_id, None, None))
            self._wake.set()

    def abort(self, request_id: str) -> None:
        """Stop a request (its stream ends with finish_reason "abort"); unknown ids are ignored."""
        with self._lock:
            self._commands.append(("abort", request_id, None, None))
        self._wake.set()

    # ---- the engine thread --------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                self._run_commands()
                if self._stop.is_set():
                    self._deliver(self.engine.step() if self.engine.has_unfinished() else [])
                    return
                if not self.engine.has_unfinished():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                self._deliver(self.engine.step())
        except BaseException as exc:  # noqa: BLE001 - every waiting request must hear about it
            log.critical("FATAL: the engine stopped on an error in state that every request "
                         "shares (%s: %s); requests in flight fail with 503 and the server must "
                         "be restarted", type(exc).__name__, exc, exc_info=exc)
            self.error = exc
            self._fail_all(EngineDeadError(f"the engine stopped on an error: {exc!r}"))

    def _run_commands(self) -> None:
        while True:
            with self._lock:
                if not self._commands:
                    return
                kind, rid, prompt, params = self._commands.popleft()
            if kind == "abort":
                self.engine.abort(rid)
                continue
            try:
                self.engine.add_request(rid, prompt, params)
            except (RequestError, RequestFailedError) as exc:  # nothing was queued
                self._send(rid, exc)

    def _deliver(self, outputs: Sequence[RequestOutput]) -> None:
        for out in outputs:
            if out.finish_reason == "error":
                self._send(out.request_id, RequestFailedError(out.request_id, out.error or "?"))
            else:
                self._send(out.request_id, out)

    def _send(self, request_id: str, item) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
            except RuntimeError:  # the caller's event loop is closed: nobody is listening
                pass

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            streams = list(self._streams)
        for rid in streams:
            self._send(rid, exc)
