"""The judge's side of one verification: start the worker, run the session, judge, clean up.

Called by `verify.verify_variant` after the static screen and the plan. The references are
computed at the contracts' GEMM precision (model/ops/precision.py: no TF32, no reduced-precision
split-K reductions) and the flags are restored after.
"""

from __future__ import annotations

import json
import logging
import secrets as _secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from autoopt.env import REPO_ROOT
from model.ops.precision import contract_precision

from .channel import Worker, WorkerError
from .judgement import judge_near_misses, judge_numerics
from .plan import Budget, Secret, ShapePlan
from .session import build_steps, run_steps
from .trials import Judge

log = logging.getLogger("autoopt.eval")  # one line per phase: where a slow verification spends

POISON_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.int32)


@dataclass(frozen=True)
class PerBucket:
    """A config per token bucket ("T=8" -> config; None: the variant's DEFAULT_CONFIG), which
    the worker picks call by call as serving does: the registry's nearest-bucket rule on the
    call's token count. One verification then judges every config on the calls that would get
    it (the buckets' own shapes, the drawn and edge shapes nearest them), instead of one whole
    verification per distinct config. With `served` (the fixed dims' sizes the configs were
    tuned at), a call at other sizes gets the variant's DEFAULT_CONFIG, as serving's lookup
    gives it there (and on a GPU of the arch with no tuned configs): the default is judged too,
    on the cases at widths nobody chose. Without it the table applies at every width."""
    table: tuple[tuple[int, dict | None], ...]
    token_at: tuple[int, int]  # (argument index, axis) of the call's token count
    dims_at: tuple[tuple[int, int], ...] = ()  # (argument index, axis) of each fixed dim
    served: tuple[tuple[int, ...], ...] = ()  # their sizes where the table applies; (): anywhere

    @classmethod
    def of(cls, op: str, per_bucket: Mapping[str, Mapping | None],
           served_shapes: Sequence[Mapping[str, int]] = ()) -> PerBucket | None:
        """None where the op has no token axis, no bucket has a config, or one config covers
        every bucket at every width (no `served_shapes`: shapes at the widths the configs are
        for, the target's buckets; with them a single tuned config still leaves the other
        widths to the default)."""
        from model.registry.configs import call_axes

        fixed, token_at = call_axes(op)
        configs = {json.dumps(dict(c) if c is not None else None, sort_keys=True)
                   for c in per_bucket.values()}
        names = [name for _, _, name in fixed]
        served = tuple(sorted({tuple(int(s[n]) for n in names) for s in served_shapes
                               if all(n in s for n in names)}))
        if token_at is None or configs <= {"null"} or (len(configs) < 2 and not served):
            return None
        table = tuple(sorted((int(str(b).removeprefix("T=")), dict(c) if c is not None else None)
                             for b, c in per_bucket.items()))
        return cls(table, token_at, tuple((i, axis) for i, axis, _ in fixed) if served else (),
                   served)

    def describe(self) -> dict[str, dict | None]:
        return {f"T={b}": c for b, c in self.table}

    def single(self) -> dict | None:
        """The one tuned config every bucket has (what a report names as its config), or None."""
        distinct = {json.dumps(c, sort_keys=True) for _, c in self.table}
        return dict(self.table[0][1]) if len(distinct) == 1 and self.table[0][1] else None


def start_candidate(w: Worker, text: bytes, device: str, config: dict | PerBucket | None,
                    palettes: dict[torch.dtype, torch.Tensor], seed: int) -> str | None:
    """Load the screened bytes (a private copy) in the worker; the import error, if any."""
    from .verify import preloads, worker_imports

    path = w.tmp / f"variant_{_secrets.token_hex(6)}.py"
    path.write_bytes(text)
    chosen = {"config": None, "configs": [list(e) for e in config.table],
              "token_at": list(config.token_at), "dims_at": [list(d) for d in config.dims_at],
              "served": [list(d) for d in config.served]} if isinstance(config, PerBucket) \
        else {"config": config}
    reply = w.request({"cmd": "load", "device": device, "path": str(path),
                       "module": f"_variant_{_secrets.token_hex(6)}", **chosen,
                       "preload": preloads(text.decode("utf-8", "replace")),
                       "repo_root": str(REPO_ROOT), "imports": worker_imports(),
                       "rng_seed": _secrets.randbits(62)})
    if "error" in reply:
        return f"worker could not load the variant: {reply['error']}"
    if "import_error" in reply:
        return f"import failed: {reply['import_error']}"
    names = [str(dt).removeprefix("torch.") for dt in palettes]
    descs = w.pack(list(palettes.values()))
    w.request({"cmd": "palette", "palettes": dict(zip(names, descs, strict=True)),
               "seed": seed})
    return None


def palette_bits(palettes: dict[torch.dtype, torch.Tensor]) -> dict[torch.dtype, torch.Tensor]:
    """Sorted keys of every run of cyclic neighbours of each floating palette (trials.py)."""
    from .trials import pair_keys

    out = {}
    for dt, p in palettes.items():
        if dt.is_floating_point:
            out[dt] = torch.unique(pair_keys(torch.cat([p, p[:2]])))
    return out


def judge_candidate(report: Any, c: Any, text: bytes, plan: ShapePlan, budget: Budget,
                    s: Secret, *, config: dict | None, timeout_s: float, time_check: bool,
                    racecheck: bool | None, memcheck: bool = False) -> None:
    from .verify import CPU_MEM_LIMIT, run_env

    device = report.device
    cuda = device.startswith("cuda")
    report.env = run_env(device)
    reasons: list[str] = []
    t0 = time.monotonic()
    log.info("%s: judging on %s (%d shapes planned)", c.name, device,
             len(plan.buckets) + len(plan.drawn) + len(plan.long))
    with contract_precision(), Worker(device, budget_s=timeout_s,
                                      mem_limit_bytes=None if cuda else CPU_MEM_LIMIT) as w:
        try:
            reasons += _session(report, c, w, text, plan, budget, s, config, time_check)
            report.checks["sandbox"] = {"blocked": w.request({"cmd": "ping"})["blocked"],
                                        "worker_start_s": round(w.started_s, 3),
                                        "requests": w.requests}
        except WorkerError as e:
            reasons.append(str(e) if e.kind == "timeout" else f"worker: {e}")
            report.checks["sandbox"] = {"error": str(e), "kind": e.kind,
                                        "stderr_tail": w.stderr_tail()[-1500:]}
    blocked = report.checks["sandbox"].get("blocked", [])
    reasons += [f"sandbox: blocked {b}" for b in blocked[:3]]
    log.info("%s: trials done in %.0f s, %d reasons", c.name, time.monotonic() - t0,
             len(reasons))
    t1 = time.monotonic()
    report.checks["races"] = _races(report, c, text, plan, s, config, cuda, racecheck,
                                    failed=bool(reasons), timeout_s=timeout_s)
    log.info("%s: races %s in %.0f s", c.name, report.checks["races"].get("status"),
             time.monotonic() - t1)
    if report.checks["races"].get("reason"):
        reasons.append(report.checks["races"]["reason"])
    if memcheck:
        report.checks["memcheck"] = _memcheck(c, text, plan, s, config, report.device,
                                              failed=bool(reasons), timeout_s=timeout_s)
        log.info("%s: memcheck %s", c.name, report.checks["memcheck"].get("status"))
        if report.checks["memcheck"].get("reason"):
            reasons.append(report.checks["memcheck"]["reason"])
    report.reasons = reasons


def _memcheck(c: Any, text: bytes, plan: ShapePlan, s: Secret, config: dict | None,
              device: str, failed: bool, timeout_s: float) -> dict[str, Any]:
    from .races import gpu_memcheck, is_kernel_language

    if not device.startswith("cuda"):
        return {"status": "not checked (no GPU; the interpreter ends a worker that reads or "
                          "writes out of bounds)"}
    if not is_kernel_language(text):
        return {"status": "not needed (no Triton or CuTe kernel)"}
    if failed:
        return {"status": "not run (already rejected)"}
    return gpu_memcheck(c, text, plan, s, config, device, timeout_s)


def _session(report: Any, c: Any, w: Worker, text: bytes, plan: ShapePlan, budget: Budget,
             s: Secret, config: dict | None, time_check: bool) -> list[str]:
    palettes = {dt: s.palette(dt) for dt in POISON_DTYPES}
    err = start_candidate(w, text, report.device, config, palettes, s.seed())
    if err:
        report.checks["import"] = {"passed": False, "error": err}
        return [err]
    report.checks["import"] = {"passed": True}
    j = Judge(c, w, report.device, palette_bits(palettes), rng=s.rng)
    specs, steps = build_steps(plan, budget, s)
    report.seeds = sorted({seed for _, seed, _ in specs})
    t0 = time.monotonic()
    burst = run_steps(j, specs, steps, budget, s)
    took = time.monotonic() - t0
    by_step = dict(sorted(((k, round(v, 2)) for k, v in j.by_step.items()),
                          key=lambda kv: -kv[1]))
    report.checks["judge_time_s"] = {"trials": round(took, 2),
                                     **{k: round(v, 4) for k, v in j.spent.items()},
                                     "by_step": by_step}
    log.info("%s: %d steps, %d calls in %.0f s (inputs %.0f s, reference %.0f s, near misses "
             "%.0f s, transfers %.0f s, candidate calls %.0f s; by step: %s)", c.name,
             len(steps), j.calls, took,
             *(j.spent[k] for k in ("inputs", "reference", "near_misses", "transfers", "calls")),
             ", ".join(f"{k} {v:.0f} s" for k, v in list(by_step.items())[:5]))
    reasons = j.findings.reasons()
    if not j.per_shape and not reasons:
        reasons.append("no trial completed (no shapes given)")
    more, report.checks["numerics"] = judge_numerics(j, report.device)
    reasons += more
    more, report.checks["near_misses"] = judge_near_misses(j)
    reasons += more
    report.per_shape = j.per_shape
    report.checks["behaviour"] = {"calls": j.calls, "failed": dict(j.findings.count),
                                  "steps": len(steps), "burst": burst, "marathon": j.marathon,
                                  "state": j.state_checks, "skipped_edge_cases": j.skipped}
    if c.name == "router":
        report.checks["router_ties"] = {"rows": j.router_ties[:50],
                                        "tolerated": sum(r["tie"] for r in j.router_ties)}
    if report.device.startswith("cuda") and time_check and not reasons:
        from .timing import floor_check

        t0 = time.monotonic()
        reasons += floor_check(j, plan, s, report.checks)
        log.info("%s: timing checks in %.0f s", c.name, time.monotonic() - t0)
    return reasons


def _races(report: Any, c: Any, text: bytes, plan: ShapePlan, s: Secret, config: dict | None,
           cuda: bool, racecheck: bool | None, failed: bool,
           timeout_s: float | None = None) -> dict[str, Any]:
    from .races import gpu_racecheck, is_kernel_language

    cpu_note = ("programs of interpreted Triton launches run in natural, reversed and random "
                "orders on the follow-up cases; outputs compared bitwise")
    if not cuda:
        return {"status": "not checked (no GPU)", "racecheck": "not checked (no GPU)",
                "program_order": cpu_note}
    wanted = is_kernel_language(text) if racecheck is None else racecheck
    if not wanted:
        return {"status": "not needed (no Triton or CuTe kernel)" if racecheck is None
                else "skipped (racecheck=False)"}
    if failed:
        return {"status": "not run (already rejected)"}
    return gpu_racecheck(c, text, plan, s, config, report.device, timeout_s)
