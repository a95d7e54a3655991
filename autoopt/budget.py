"""The time plan of `autoopt optimize --budget`, and the ledger of what a run spends.

The budget bounds the whole command.

Before any work the run is planned from the budget: how many batch sizes the profile covers,
whether and at which batch sizes the end-to-end `bench model` check runs, and the time left to
the agent sessions; the plan is printed, so the user knows up front what the run will do in that
time. Each stage then has a deadline (absolute, from the command's start): profiling stops
between batch sizes at its deadline, sessions start no op and no proposal past theirs (and a
running verification's child is bounded by it), the end-to-end check starts no row past its
own, and the report comes last. Stage costs are estimates per machine kind (`COSTS`); a stage
that ends early leaves its time to the next one.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Costs:
    """Estimated seconds of each fixed stage on one kind of machine."""

    profile_fixed: float  # model build, ceilings, engine (graph capture)
    profile_per_batch: float
    e2e_fixed: float  # model build for the check
    e2e_per_set: float  # one engine per kernel set (graph capture)
    e2e_per_row: float  # one (batch, set): recorded pass, kernel count, timed steps
    report: float
    min_sessions: float  # below this the agent sessions are not worth starting
    min_op: float  # an op's session gets at least this long (one proposal verified, timed)
    min_start: float  # no op starts with less than this left (a cheap op may still finish)

    def __post_init__(self) -> None:
        bad = {k: v for k, v in vars(self).items() if not v >= 0}
        if bad:
            raise ValueError(f"stage costs must be seconds >= 0, got {bad}")


COSTS = {
    # 2-core CPU, cpu-tiny (Triton interpreter; bf16 matmuls on the CPU), measured under load.
    "cpu": Costs(profile_fixed=4.0, profile_per_batch=4.0, e2e_fixed=3.0, e2e_per_set=1.0,
                 e2e_per_row=6.0, report=8.0, min_sessions=60.0, min_op=60.0,
                 min_start=20.0),
    # One H200, a 52-layer TP8 rank (random weights filled on the GPU), measured: the profile at
    # batch 1, model build and capture included, 11 s; `bench model` 6 s to build, the first
    # kernel set's graph capture at a batch 12-15 s (the next sets' 0.3-2 s once Triton's cache
    # is warm; a cold cache compiles each locked kernel first), a timed row 0.3-1.5 s.
    "gpu": Costs(profile_fixed=10.0, profile_per_batch=12.0, e2e_fixed=10.0, e2e_per_set=10.0,
                 e2e_per_row=6.0, report=10.0, min_sessions=120.0, min_op=120.0,
                 min_start=60.0),
}
E2E_SETS = 3  # reference, tuned, the run's new set
COMPILE_SETS = 2  # torch.compile's set (with --compile) costs about two: Inductor compiles first


@dataclass(frozen=True)
class Stage:
    name: str
    seconds: float
    what: str


@dataclass(frozen=True)
class RunPlan:
    budget_s: float
    profile_batches: tuple[int, ...]
    e2e_batches: tuple[int, ...]  # () = no end-to-end check
    stages: tuple[Stage, ...]  # profile, sessions, [e2e], report: in order
    min_op_s: float = 0.0  # an op's session gets at least this long, where there is time
    min_start_s: float = 0.0  # no op's session starts with less than this left

    def seconds(self, name: str) -> float:
        return next((s.seconds for s in self.stages if s.name == name), 0.0)

    def deadlines(self, start: float) -> dict[str, float]:
        """Absolute end of each stage: profile from the start; the others from the end of the
        budget backwards, so time a stage did not use passes to the next."""
        end = start + self.budget_s
        report = end
        e2e = report - self.seconds("report")
        sessions = e2e - self.seconds("e2e")
        return {"profile": start + self.seconds("profile"), "sessions": sessions, "e2e": e2e,
                "report": report}

    def describe(self) -> list[str]:
        out = [f"budget {self.budget_s:.0f} s, planned:"]
        for s in self.stages:
            out.append(f"  {s.name:9s} {s.seconds:6.0f} s  {s.what}")
        return out


def _fixed(c: Costs, n_profile: int, n_e2e: int, sets: int = E2E_SETS) -> tuple[float, float]:
    profile = c.profile_fixed + c.profile_per_batch * n_profile
    e2e = c.e2e_fixed + sets * (c.e2e_per_set + c.e2e_per_row * n_e2e) if n_e2e else 0.0
    return profile, e2e


def plan_run(budget_s: float, kind: str, batches: Sequence[int], e2e: bool = True,
             costs: Costs | None = None, compile: bool = False) -> RunPlan:
    """The plan for `budget_s` on `kind` ("cpu" or "gpu") at the target's `batches`: the
    largest of (every batch profiled and checked) > (one profiled, every one checked) > (one and
    one) > (one profiled, no check) that leaves the sessions their minimum."""
    if budget_s <= 0:
        raise ValueError(f"the budget must be positive, got {budget_s}")
    c = costs or COSTS[kind]
    batches = tuple(batches)
    first = batches[:1]
    levels = [(batches, batches if e2e else ()), (first, batches if e2e else ()),
              (first, first if e2e else ()), (first, ())]
    sets = E2E_SETS + (COMPILE_SETS if compile else 0)
    for prof, check in levels:
        p_s, e_s = _fixed(c, len(prof), len(check), sets)
        if budget_s - p_s - e_s - c.report >= c.min_sessions:
            break
    sessions = max(0.0, budget_s - p_s - e_s - c.report)
    each = (f", at least {c.min_op:.0f} s per op started (~{int(sessions // c.min_op)} op(s) "
            "at most)")
    stages = [Stage("profile", p_s, f"the served step at batch {', '.join(map(str, prof))} "
                    "(tuned set), ops ranked by time above their floor"),
              Stage("sessions", sessions, "agents propose; every candidate verified"
                    + (" (timed on the GPU)" if kind == "gpu" else " (CPU: nothing timed)")
                    + each)]
    if check:
        stages.append(Stage("e2e", e_s, "bench model: reference vs tuned vs the run's set"
                            + (" vs torch.compile" if compile else "")
                            + f" at batch {', '.join(map(str, check))}"))
    stages.append(Stage("report", c.report, "report.md with ms per step against the floor"))
    return RunPlan(budget_s, prof, check, tuple(stages), c.min_op, c.min_start)


# ---- the ledger ------------------------------------------------------------------------------
TOKEN_FIELDS = ("input_tokens", "output_tokens", "cache_creation_input_tokens",
                "cache_read_input_tokens")


class Ledger:
    """What a run spends, across its sessions and workers (thread-safe; JSON in the run state).

    API: per session (`<op>/<session>`), the model, calls, the four token counts of the API's
    usage fields and USD priced from them (the agent's price table). Device: per worker, the
    jobs it ran by kind and their seconds on the device, for every agent."""

    def __init__(self, data: Mapping[str, Any] | None = None) -> None:
        data = data or {}
        self.api: dict[str, dict] = {k: dict(v) for k, v in (data.get("api") or {}).items()}
        self.device: dict[str, dict] = {k: dict(v) for k, v in
                                        (data.get("device") or {}).items()}
        self.lost: list[str] = list(data.get("lost") or [])
        self._lock = threading.Lock()

    def api_call(self, session: str, model: str, usage: Mapping[str, Any], usd: float) -> None:
        with self._lock:
            row = self.api.setdefault(session, {"model": model, "calls": 0, "usd": 0.0,
                                                **dict.fromkeys(TOKEN_FIELDS, 0)})
            row["calls"] += 1
            row["usd"] += float(usd)
            for k in TOKEN_FIELDS:
                row[k] += int(usage.get(k) or 0)

    def device_job(self, worker: str, kind: str, seconds: float) -> None:
        with self._lock:
            row = self.device.setdefault(worker, {"jobs": 0, "seconds": 0.0, "by_kind": {}})
            row["jobs"] += 1
            row["seconds"] += float(seconds)
            k = row["by_kind"].setdefault(kind, {"jobs": 0, "seconds": 0.0})
            k["jobs"] += 1
            k["seconds"] += float(seconds)

    def worker_lost(self, line: str) -> None:
        with self._lock:
            self.lost.append(line)

    def usd(self) -> float:
        with self._lock:
            return sum(r["usd"] for r in self.api.values())

    def totals(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {"usd": sum(r["usd"] for r in self.api.values()),
                                   "calls": sum(r["calls"] for r in self.api.values())}
            for k in TOKEN_FIELDS:
                out[k] = sum(r[k] for r in self.api.values())
            out["device_s"] = sum(r["seconds"] for r in self.device.values())
            out["jobs"] = sum(r["jobs"] for r in self.device.values())
            out["workers"] = len(self.device)
            return out

    def line(self) -> str:
        """One live log line: money and tokens (when an API was used), device time."""
        t = self.totals()
        api = (f"${t['usd']:.4f} ({_k(t['input_tokens'])} in + {_k(t['output_tokens'])} out "
               f"tokens, {_k(t['cache_read_input_tokens'])} cache reads, {t['calls']} API "
               "calls); " if t["calls"] else "")
        return (f"spent: {api}device {t['device_s']:.0f} s over {t['jobs']} job(s) on "
                f"{t['workers']} worker(s)")

    def to_json(self) -> dict[str, Any]:
        with self._lock:
            return {"api": {k: dict(v) for k, v in self.api.items()},
                    "device": {k: {**v, "by_kind": {n: dict(b) for n, b in
                                                    v["by_kind"].items()}}
                               for k, v in self.device.items()},
                    "lost": list(self.lost)}


def _k(n: int) -> str:
    return f"{n / 1000:.1f}k" if n >= 1000 else str(n)


__all__ = ["COSTS", "Costs", "Ledger", "RunPlan", "Stage", "plan_run"]
