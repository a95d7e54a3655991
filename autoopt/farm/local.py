"""Evaluation workers on this machine: inline (one, in this process) or one process per device.

`InlineFarm` runs jobs one at a time on one thread of this process: the single-worker default,
the same as evaluating in the loop itself. `LocalFarm` starts one worker process per device
(`spawn`), each pinned before CUDA starts: a GPU worker sees only its GPU (CUDA_VISIBLE_DEVICES)
as cuda:0, so the judge's sandboxed children it spawns inherit it; a CPU worker runs the Triton
interpreter. Jobs wait in one queue and each worker takes the next when it is free, so a
candidate is timed alone on its GPU. A worker process that dies (killed, out of memory) is
replaced and its job goes back to the queue, up to `retries` times, to be taken by whichever
worker is free next.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from .jobs import Job, execute


class InlineFarm:
    """One worker: jobs run one after another on a thread of this process, on `device`."""

    kind = "inline"

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        self.workers = [device]
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="autoopt-eval")

    def submit(self, job: Job) -> Future:
        return self._pool.submit(execute, job, self.device)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> InlineFarm:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _pin(device: str) -> None:
    from autoopt import env

    if device.startswith("cuda:"):
        env.pin_cuda_device(device.split(":", 1)[1])
    else:
        env.enable_triton_interpreter()


def _run_pinned(job: Job, device: str) -> dict:
    return execute(job, "cuda:0" if device.startswith("cuda") else "cpu")


class _Slot:
    def __init__(self, device: str, ctx: Any) -> None:
        self.device, self.ctx = device, ctx
        self.pool = self._start()

    def _start(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(1, mp_context=self.ctx, initializer=_pin,
                                   initargs=(self.device,))

    def restart(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.pool = self._start()


class LocalFarm:
    """One worker process per entry of `devices` ("cuda:0", "cuda:1", or "cpu" repeated)."""

    kind = "local"

    def __init__(self, devices: list[str], retries: int = 2, mp_context: str = "spawn") -> None:
        if not devices:
            raise ValueError("a local farm needs at least one device")
        self.workers = list(devices)
        self.retries = retries
        self.lost: list[str] = []  # one line per worker process that died under a job
        self._q: queue.Queue = queue.Queue()
        ctx = mp.get_context(mp_context)
        self._slots = [_Slot(d, ctx) for d in devices]
        self._threads = [threading.Thread(target=self._serve, args=(s,), daemon=True,
                                          name=f"autoopt-farm-{k}")
                         for k, s in enumerate(self._slots)]
        for t in self._threads:
            t.start()

    def submit(self, job: Job) -> Future:
        fut: Future = Future()
        self._q.put((job, fut, 0))
        return fut

    def _serve(self, slot: _Slot) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            job, fut, tries = item
            if tries == 0 and not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(slot.pool.submit(_run_pinned, job, slot.device).result())
            except BrokenProcessPool as e:
                self.lost.append(f"worker on {slot.device} died running a {job.kind} job for "
                                 f"{job.op} (try {tries + 1})")
                slot.restart()
                if tries < self.retries:
                    self._q.put((job, fut, tries + 1))  # the next free worker takes it
                else:
                    fut.set_exception(RuntimeError(f"{job.kind} job for {job.op}: its worker "
                                                   f"died {tries + 1} times ({e})"))
            except BaseException as e:  # noqa: BLE001 - the job's own error goes to its caller
                fut.set_exception(e)

    def close(self) -> None:
        for _ in self._threads:
            self._q.put(None)
        for t in self._threads:
            t.join(timeout=5)
        for s in self._slots:
            s.pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> LocalFarm:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["InlineFarm", "LocalFarm"]
