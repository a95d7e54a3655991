"""Where candidate evaluations run: a queue of jobs served by evaluation workers.

The agents' sessions, the run state, the registry writes and the report stay in the head (the
`autoopt optimize` process); every job that touches a device (verify and time a candidate, tune
a template's configs, check one shape, profile with Nsight Compute) goes to a farm:

    jobs.py       the jobs, each self-contained (sources, shapes, configs) and JSON-able back
    languages.py  per kernel language, what runs before the judge (CuTe DSL: its compile check)
    check.py      one small shape against the reference (`check_candidate`)
    profile.py    Nsight Compute metrics of a candidate's kernels (`profile_candidate`)
    local.py      InlineFarm (one worker in this process), LocalFarm (a process per device)
    ray_farm.py   RayFarm: Ray tasks pinned to one GPU each, retried when a worker is lost

`open_farm(spec)` picks one by what the run asked for; every farm has `submit(job) -> Future`,
`workers` (one name per slot) and `close()`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .jobs import CheckJob, EvalJob, Job, ProfileJob, TuneJob, execute


class Farm(Protocol):
    kind: str
    workers: list[str]

    def submit(self, job: Job) -> Any:
        """A concurrent.futures.Future of `execute(job, device)` on some worker."""

    def close(self) -> None: ...


@dataclass(frozen=True)
class FarmSpec:
    """What the run asked for: devices on this machine, or a Ray address."""

    devices: tuple[str, ...] = ("cpu",)  # one worker per entry ("cuda:1", or "cpu" repeated)
    ray_address: str | None = None  # Ray's forms, or "local" for a cluster started here
    gpu: bool = False  # GPU jobs (Ray: num_gpus=1 per task)

    def __post_init__(self) -> None:
        if not self.devices and self.ray_address is None:
            raise ValueError("a farm needs devices or a Ray address")

    @property
    def kind(self) -> str:
        if self.ray_address is not None:
            return "ray"
        return "inline" if len(self.devices) == 1 else "local"


def _inline(spec: FarmSpec) -> Farm:
    from .local import InlineFarm

    return InlineFarm(spec.devices[0])


def _local(spec: FarmSpec) -> Farm:
    from .local import LocalFarm

    return LocalFarm(list(spec.devices))


def _ray(spec: FarmSpec) -> Farm:
    from .ray_farm import RayFarm

    n = len(spec.devices) if spec.devices else None
    return RayFarm(spec.ray_address or "local", gpu=spec.gpu,
                   num_cpus=None if spec.gpu else n, num_gpus=n if spec.gpu else None)


FARMS: dict[str, Callable[[FarmSpec], Farm]] = {"inline": _inline, "local": _local, "ray": _ray}


def open_farm(spec: FarmSpec) -> Farm:
    return FARMS[spec.kind](spec)


__all__ = ["FARMS", "CheckJob", "EvalJob", "Farm", "FarmSpec", "Job", "ProfileJob", "TuneJob",
           "execute", "open_farm"]
