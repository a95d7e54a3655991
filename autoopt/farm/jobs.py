"""The jobs an evaluation worker runs: whatever touches a device, and nothing that writes.

A job is a frozen dataclass that carries everything it needs (the candidate's source text, the
baseline's, the shapes, the configs), so it runs the same on a thread of the head, in a local
worker process pinned to one GPU, or as a Ray task on another host; it returns plain JSON-able
data. Registry writes, the run state and the decision stay on the head (autoopt/loop_eval.py).

    EvalJob     verify a candidate (once per distinct config) and, on a GPU, time it and the
                current selection at the bench shapes, back to back on the same GPU
    TuneJob     time a built-in template under several configs at one shape (trusted code)
    CheckJob    one small shape against the reference: compile errors or the first mismatches
    ProfileJob  Nsight Compute metrics of a verified candidate's kernels (profile.py)

`execute(job, device)` runs one and adds where and how long it ran (device seconds, counted in
the run's ledger).
"""

from __future__ import annotations

import json
import math
import os
import socket
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol

from .languages import precheck


class Job(Protocol):
    kind: ClassVar[str]
    op: str

    def run(self, device: str) -> dict:
        """Run on `device` ("cpu", "cuda:0"); plain data back."""


def execute(job: Job, device: str) -> dict:
    """`job.run(device)` with the worker's name, pid and the job's wall seconds on the device."""
    start = time.monotonic()
    out = job.run(device)
    return {**out, "device_s": time.monotonic() - start, "kind": job.kind,
            "worker": f"{socket.gethostname()}/{_physical(device)}", "pid": os.getpid()}


def _physical(device: str) -> str:
    """The GPU a pinned worker's cuda:0 is (its CUDA_VISIBLE_DEVICES), else the device."""
    from autoopt import env

    visible = env.cuda_visible_devices()
    if device.startswith("cuda") and visible:
        return f"cuda:{visible.split(',')[0]}"
    return device


def _write(folder: Path, name: str, source: str) -> Path:
    path = folder / f"{name}.py"
    path.write_text(source)
    return path


def distinct(configs: Sequence[Mapping | None]) -> list[dict | None]:
    out: list[dict | None] = []
    for cfg in configs:
        c = dict(cfg) if cfg else None
        if c not in out:
            out.append(c)
    return out or [None]


# ---- verify and time ----------------------------------------------------------------------
_BASELINES: dict[str, list[dict]] = {}  # per worker process: baseline timings already taken
MIN_STAGE_S = 5.0  # a verification or timing given less than this is not started
DEADLINE_SLACK_S = 2.0  # a timeout this near the job's end is the deadline's, not the candidate's


@dataclass(frozen=True)
class EvalJob:
    """Verify `source` for `op` and, when `timed`, bench it and the baseline."""

    kind: ClassVar[str] = "eval"
    op: str
    name: str  # the candidate's file stem
    source: str
    configs: tuple[dict | None, ...] = (None,)  # verified one by one, first failure stops
    per_bucket: Mapping[str, dict | None] = field(default_factory=dict)  # "T=n" -> config
    bench_shapes: tuple[dict, ...] = ()
    verify_shapes: tuple[dict, ...] = ()  # () = the harness's defaults merged with bench ones
    verify_seeds: int = 3
    verify_tokens: tuple[int, ...] = ()
    timed: bool = False
    baseline_name: str = "reference"
    baseline_source: str | None = None
    baseline_per_bucket: Mapping[str, dict | None] = field(default_factory=dict)
    language: str = "triton"
    compile: bool = False
    warmup: int = 10
    iters: int = 50
    timeout_s: float = 300.0  # each verification's and each timing's limit
    budget_s: float | None = None  # the whole job's (the op's deadline); None: no such bound

    def run(self, device: str) -> dict:
        end = time.monotonic() + (self.budget_s if self.budget_s is not None else math.inf)
        with tempfile.TemporaryDirectory(prefix="autoopt-job-") as tmp:
            path = _write(Path(tmp), self.name, self.source)
            compile_errors = precheck(self.language, path, device)
            if compile_errors:
                return {"reasons": compile_errors, "reports": [], "rows": [],
                        "baseline_rows": [], "stage": "compile"}
            reasons, reports, cut = self._verify(path, device, end)
            out: dict[str, Any] = {"reasons": reasons, "reports": reports, "rows": [],
                                   "baseline_rows": [], "stage": "verify"}
            if cut:
                out["unjudged"] = cut
            if reasons or not self.timed:
                return out
            # Timing shares the job's limit (an op's deadline): a candidate verified just in
            # time is left untimed, and so undecided, rather than overrunning the deadline.
            try:
                rows = _bench(self.op, path, self.bench_shapes, self.per_bucket, device, self,
                              end)
                base = self._baseline(Path(tmp), device, end)
            except TimeoutError as e:
                out["untimed"] = str(e)
                return out
            out["rows"], out["baseline_rows"], out["stage"] = rows, base, "bench"
            return out

    def shapes(self, device: str) -> list[dict]:
        from autoopt.eval.shapes import default_shapes

        if self.verify_shapes:
            return [dict(s) for s in self.verify_shapes]
        out: list[dict] = []
        for s in [*default_shapes(self.op, device, self.verify_tokens or None),
                  *self.bench_shapes]:
            if dict(s) not in out:
                out.append(dict(s))
        return out

    def _verify(self, path: Path, device: str, end: float
                ) -> tuple[list[str], list[dict], str | None]:
        """(reasons, reports, why it is unjudged or None). A verification that times out only
        because the job's deadline cut its limit short says nothing about the candidate: it is
        neither passed nor rejected, and the third element says so."""
        from autoopt.eval.run import PerBucket
        from autoopt.eval.verify import verify_variant

        shapes = self.shapes(device)
        reasons: list[str] = []
        reports: list[dict] = []
        configs: list[Any] = distinct(self.configs)
        per = PerBucket.of(self.op, self.per_bucket, self.bench_shapes)
        if per is not None and _same_configs(configs, [c for _, c in per.table]):
            # Every config on the calls serving would give it, in one verification (a template's
            # proposal has one per bucket; one whole verification each took ~50 s on an H200),
            # and the variant's default at other widths, where serving's lookup gives it.
            configs = [per]
        for cfg in configs:
            limit = self.stage_s(end)
            rep = verify_variant(self.op, path, device=device, seeds=self.verify_seeds,
                                 shapes=shapes, config=cfg, timeout_s=limit)
            reports.append(rep.to_dict())
            if not rep.passed:
                where = ("with its config per bucket: " if per and cfg is per else
                         f"with config {cfg}: " if len(configs) > 1 else "")
                if (limit < self.timeout_s and time.monotonic() >= end - DEADLINE_SLACK_S
                        and rep.reasons and all("timeout after" in r for r in rep.reasons)):
                    return [], reports, (
                        f"not judged: the job's {self.budget_s:.0f} s ran out {where}during "
                        f"its verification ({limit:.0f} s were left of the "
                        f"{self.timeout_s:.0f} s a verification may take)")
                reasons += [where + r for r in rep.reasons]
                break  # the first failing config is enough evidence
        return reasons, reports, None

    def stage_s(self, end: float) -> float:
        """A verification's or timing's limit: its own, cut at the job's end; >= MIN_STAGE_S."""
        return max(MIN_STAGE_S, min(self.timeout_s, end - time.monotonic()))

    def _baseline(self, tmp: Path, device: str, end: float) -> list[dict]:
        if self.baseline_source is None:
            return []
        key = json.dumps([device, self.op, self.baseline_source, dict(self.baseline_per_bucket),
                          list(self.bench_shapes), self.iters], sort_keys=True, default=str)
        if key not in _BASELINES:
            path = _write(tmp, f"baseline_{self.baseline_name}", self.baseline_source)
            _BASELINES[key] = _bench(self.op, path, self.bench_shapes, self.baseline_per_bucket,
                                     device, self, end)
        return _BASELINES[key]


def _same_configs(a: Sequence[Any], b: Sequence[Any]) -> bool:
    def key(c: Any) -> str:
        return json.dumps(dict(c) if c is not None else None, sort_keys=True, default=str)
    return {key(c) for c in a} == {key(c) for c in b}


def bucket(shape: Mapping[str, int]) -> str:
    return f"T={int(shape['T'])}"


def _bench(op: str, path: Path, shapes: Sequence[dict], per_bucket: Mapping[str, Any],
           device: str, job: EvalJob, end: float) -> list[dict]:
    """Bench rows at `shapes` in their order, each shape under its bucket's config; a
    TimeoutError when the job's time (`end`, monotonic) runs out first."""
    from autoopt.eval.bench import bench_op

    groups: dict[str, list[dict]] = {}
    for shape in shapes:
        cfg = per_bucket.get(bucket(shape))
        groups.setdefault(json.dumps(cfg, sort_keys=True), []).append(dict(shape))
    rows = []
    for key, group in groups.items():
        cfg = json.loads(key)
        left = end - time.monotonic()
        if left < MIN_STAGE_S:
            raise TimeoutError(f"not timed: {left:.0f} s of the job's {job.budget_s:.0f} s "
                               f"were left for {path.stem}'s timing")
        try:
            timed = bench_op(op, path, group, device, compile=job.compile, config=cfg,
                             warmup=job.warmup, iters=job.iters, timeout_s=job.stage_s(end))
        except RuntimeError as e:
            if time.monotonic() < end:
                raise
            raise TimeoutError(f"not timed: {path.stem}'s timing ran past the job's "
                               f"{job.budget_s:.0f} s ({e})") from None
        rows += [{**row.to_dict(), "config": cfg} for row in timed]
    order = [json.dumps(dict(s), sort_keys=True) for s in shapes]
    return sorted(rows, key=lambda r: order.index(json.dumps(r["shape"], sort_keys=True)))


# ---- template tuning ------------------------------------------------------------------------
_INPUTS: dict[str, list[tuple]] = {}


@dataclass(frozen=True)
class TuneJob:
    """Median µs of a trusted source under each config at one shape (None: it failed)."""

    kind: ClassVar[str] = "tune"
    op: str
    name: str
    source: str
    configs: tuple[dict, ...]
    shape: Mapping[str, int]
    iters: int = 20

    def run(self, device: str) -> dict:
        from autoopt.eval.candidates import load_variant
        from autoopt.eval.timing import time_callable

        if not device.startswith("cuda"):
            return {"us": [None] * len(self.configs)}  # CPU times say nothing about a config
        with tempfile.TemporaryDirectory(prefix="autoopt-tune-") as tmp:
            variant = load_variant(_write(Path(tmp), self.name, self.source))
            sets = self._sets(device)
            out: list[float | None] = []
            for cfg in self.configs:
                try:
                    t = time_callable(lambda *a, cfg=dict(cfg): variant.run(*a, config=cfg),
                                      sets, device=device, warmup=2, iters=self.iters)
                    out.append(t.median_us)
                except Exception:  # noqa: BLE001 - a config that does not run is a failed trial
                    out.append(None)
        return {"us": out}

    def _sets(self, device: str) -> list[tuple]:
        from autoopt.eval.timing import H200_L2_BYTES, sets_needed, tensor_bytes
        from model.ops import contract

        c = contract(self.op)
        key = json.dumps([self.op, dict(self.shape), device], sort_keys=True)
        if key not in _INPUTS:
            first = c.make_inputs(dict(self.shape), 1000, device)
            n = sets_needed(tensor_bytes(first), H200_L2_BYTES)
            _INPUTS[key] = [first] + [c.make_inputs(dict(self.shape), 1000 + k, device)
                                      for k in range(1, n)]
        return _INPUTS[key]


# ---- one quick shape ------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckJob:
    """Compile and run one small shape against the reference (check.py)."""

    kind: ClassVar[str] = "check"
    op: str
    name: str
    source: str
    shape: Mapping[str, int]
    config: Mapping[str, Any] | None = None
    language: str = "triton"
    timeout_s: float = 120.0

    def run(self, device: str) -> dict:
        from .check import check_one

        with tempfile.TemporaryDirectory(prefix="autoopt-check-") as tmp:
            path = _write(Path(tmp), self.name, self.source)
            errors = precheck(self.language, path, device)
            if errors:
                return {"stage": "compile", "errors": errors, "shape": dict(self.shape)}
            return check_one(self.op, path, device, dict(self.shape),
                             dict(self.config) if self.config else None, self.timeout_s)


@dataclass(frozen=True)
class ProfileJob:
    """Nsight Compute metrics of a verified candidate's kernels at `shapes` (profile.py)."""

    kind: ClassVar[str] = "profile"
    op: str
    name: str
    source: str
    shapes: tuple[dict, ...]
    per_bucket: Mapping[str, dict | None] = field(default_factory=dict)
    launch_count: int = 24
    timeout_s: float = 300.0

    def run(self, device: str) -> dict:
        from .profile import profile_candidate

        with tempfile.TemporaryDirectory(prefix="autoopt-profile-") as tmp:
            path = _write(Path(tmp), self.name, self.source)
            return profile_candidate(self.op, path, device, [dict(s) for s in self.shapes],
                                     dict(self.per_bucket), self.launch_count, self.timeout_s,
                                     Path(tmp))


__all__ = ["CheckJob", "EvalJob", "Job", "ProfileJob", "TuneJob", "bucket", "distinct",
           "execute"]
