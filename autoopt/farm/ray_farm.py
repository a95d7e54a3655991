"""Evaluation on a Ray cluster: each job is a Ray task pinned to one GPU (or one CPU).

`RayFarm(address)` connects with `ray.init(address=...)` (Ray's own forms: "auto", "ray://host:
10001", "host:6379"), or with `address="local"` starts a cluster on this machine for the run:
dashboard off, loopback only (`env.ray_local_environment()`), `num_cpus` / `num_gpus` as asked,
stopped when the farm closes. A job runs as a task with `num_gpus=1` on a GPU run (Ray gives it
one GPU as cuda:0 and schedules one such task per GPU, so each candidate is timed alone on its
GPU) or `num_cpus=1` on a CPU run (verification only). Ray retries a task whose worker process
or node was lost (`max_retries`) on whichever worker is free next; the job itself carries
everything it needs (sources, shapes, configs), so it needs no file of the head. Workers must
import the same autoopt as the head (`pip install autoopt[farm]` on every node).
"""

from __future__ import annotations

import os
import shutil
import sys
from concurrent.futures import Future
from typing import Any

from .jobs import Job, execute

LOCAL = "local"
# Characters from Ray's temp dir to its longest socket path, with room for a 7-digit pid.
RAY_SOCKET_SUFFIX = len("/session_2026-01-01_00-00-00_000000_1234567/sockets/plasma_store") + 4


def _remote_run(job: Job, gpu: bool) -> dict:
    if not gpu:
        from autoopt import env

        env.enable_triton_interpreter()
    return execute(job, "cuda:0" if gpu else "cpu")


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RuntimeError("--ray-address needs Ray: pip install 'autoopt[farm]' (or "
                           "pip install ray)") from None
    return ray


class RayFarm:
    """Jobs as Ray tasks; `workers` lists the slots the cluster offers for them."""

    kind = "ray"

    def __init__(self, address: str, *, gpu: bool, num_cpus: int | None = None,
                 num_gpus: int | None = None, max_retries: int = 3) -> None:
        from autoopt import env

        self.gpu, self.address = gpu, address
        self.started = address == LOCAL
        if self.started:
            wanted = env.ray_local_environment()
            if "ray" in sys.modules and any(os.environ.get(k) != v for k, v in wanted.items()):
                raise RuntimeError("--ray-address local must set Ray's loopback-only mode "
                                   "before ray is imported, and ray is already imported in "
                                   "this process")
            os.environ.update(wanted)
        ray = import_ray()
        if ray.is_initialized():
            raise RuntimeError("Ray is already initialised in this process; one farm at a time")
        kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                              "configure_logging": False}
        self._temp_dir = None
        if self.started:
            # A session's sockets lie ~70 characters below Ray's temp dir (<dir>/ray/session_<time>
            # _<pid>/sockets/plasma_store): under a long TMPDIR they would pass the socket limit.
            self._temp_dir = env.socket_safe_tmpdir(RAY_SOCKET_SUFFIX)
            if self._temp_dir:
                kw["_temp_dir"] = self._temp_dir
            ray.init(num_cpus=num_cpus or 2, num_gpus=num_gpus,
                     object_store_memory=128 << 20, **kw)
        else:
            ray.init(address=address, **{k: v for k, v in kw.items()
                                         if k != "include_dashboard"})
        self._ray = ray
        opts = {"num_gpus": 1, "num_cpus": 1} if gpu else {"num_cpus": 1}
        self._remote = ray.remote(max_retries=max_retries, retry_exceptions=False,
                                  **opts)(_remote_run)
        res = ray.cluster_resources()
        slots = int(res.get("GPU", 0)) if gpu else int(res.get("CPU", 0))
        if slots < 1:
            self.close()
            raise RuntimeError(f"the Ray cluster at {address} offers no "
                               f"{'GPU' if gpu else 'CPU'} for evaluation tasks ({res})")
        kind = "gpu" if gpu else "cpu"
        self.workers = [f"ray:{kind}{k}" for k in range(slots)]

    def submit(self, job: Job) -> Future:
        return self._remote.remote(job, self.gpu).future()

    def close(self) -> None:
        if self._ray_ready():
            self._ray.shutdown()
        if getattr(self, "_temp_dir", None):
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None

    def _ray_ready(self) -> bool:
        return getattr(self, "_ray", None) is not None and self._ray.is_initialized()

    def __enter__(self) -> RayFarm:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["LOCAL", "RayFarm", "import_ray"]
