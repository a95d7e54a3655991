"""Verify a kernel variant against its op's reference: the harness, not the agent, decides.

`verify_variant` screens the source statically (nothing runs if that fails), then runs every
other check in a sandbox child with a timeout (sandbox.py): references and near misses computed
before the candidate is imported, trials over shapes x seeds (trials.py), the numerics policy
per output (numerics.py), near-miss discrimination, runtime monkeypatch detection, blocked
side effects, and on cuda the floor check. Every rejection reason names its check.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .guards import static_screen

# A CPU child never needs more address space than this; a runaway candidate is stopped by it.
CPU_MEM_LIMIT = 48 << 30


@dataclass
class VerifyReport:
    op: str
    source: str
    sha256: str
    device: str
    verdict: str  # "pass" | "reject"
    reasons: list[str]
    checks: dict[str, Any] = field(default_factory=dict)
    per_shape: list[dict] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    shapes: list[dict] = field(default_factory=list)
    config: dict | None = None
    elapsed_s: float = 0.0
    env: dict[str, Any] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=str)


def verify_variant(op: str, source: Path, *, device: str = "cpu", seeds: Sequence[int] = (0, 1, 2),
                   shapes: list[dict] | None = None, config: dict | None = None,
                   timeout_s: float = 300, time_check: bool = True) -> VerifyReport:
    """Verify the variant file `source` for `op`; never raises for the candidate's faults."""
    from model.ops import contract

    from .candidates import sha256_file
    from .sandbox import run_child
    from .shapes import default_shapes

    contract(op)  # unknown op: ValueError naming the known ones
    source = Path(source).resolve()
    if not source.is_file():
        raise FileNotFoundError(f"variant file {source} does not exist")
    shapes = [dict(s) for s in (shapes or default_shapes(op, device))]
    report = VerifyReport(op=op, source=str(source), sha256=sha256_file(source), device=device,
                          verdict="reject", reasons=[], seeds=list(seeds), shapes=shapes,
                          config=config)
    start = time.monotonic()
    screen = static_screen(source.read_text(), str(source))
    report.checks["static_screen"] = {"passed": not screen, "reasons": screen}
    if screen:
        report.reasons = screen
        report.elapsed_s = time.monotonic() - start
        return report
    params = {"op": op, "source": str(source), "device": device, "seeds": list(seeds),
              "shapes": shapes, "config": config, "time_check": time_check}
    child = run_child("verify", params, timeout_s=timeout_s, device=device,
                      mem_limit_bytes=None if device.startswith("cuda") else CPU_MEM_LIMIT)
    report.elapsed_s = time.monotonic() - start
    report.checks["sandbox"] = {"elapsed_s": child.elapsed_s, "returncode": child.returncode,
                                "timed_out": child.timed_out, "blocked": child.blocked}
    if child.timed_out:
        report.reasons = [f"timeout after {timeout_s:g} s (the candidate hung or was too slow; "
                          f"child killed)"]
        return report
    if not child.ok or child.result is None:
        report.reasons = [f"sandbox: child failed: {child.error}"]
        report.checks["sandbox"]["stderr_tail"] = child.stderr_tail
        return report
    res = child.result
    report.reasons = list(res["reasons"])
    loaded = res["checks"].get("import", {}).get("sha256")
    if loaded and loaded != report.sha256:
        report.reasons.append(f"source changed during verification (sha256 {report.sha256[:12]} "
                              f"screened, {loaded[:12]} loaded): verify the final file")
    report.checks.update(res["checks"])
    report.per_shape = res["per_shape"]
    report.env = res.get("env", {})
    report.verdict = "pass" if not report.reasons else "reject"
    return report


# ---- child side ------------------------------------------------------------------------------

def verify_job(params: dict) -> dict:
    """Runs in the sandbox child: prepare references, import the candidate, run the trials."""
    import torch

    from model.ops import contract

    from . import guards, sandbox
    from .candidates import load_variant

    device = params["device"]
    c = contract(params["op"])
    # The references are defined with TF32 off (NUMERICS.md: FP32 GEMMs are FP32).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    prepared = prepare_all(c, params["shapes"], params["seeds"], device)
    env = run_env(device)
    snapshot = guards.snapshot_globals()
    sandbox.arm(params["source"])
    checks: dict[str, Any] = {}
    try:
        variant = load_variant(Path(params["source"]))
    except Exception as e:  # the candidate's import error is a rejection, not a crash
        return {"reasons": [f"import failed: {type(e).__name__}: {e}"],
                "checks": {"import": {"passed": False, "error": str(e)}},
                "per_shape": [], "env": env}
    checks["import"] = {"passed": True, "sha256": variant.sha256}
    checks["method"] = guard_methods(device)
    reasons = _patched("at import", guards.patched_globals(snapshot))
    more, trial_checks, per_shape = run_trials(c, variant.run, prepared, params)
    reasons += more
    checks.update(trial_checks)
    reasons += _patched("during calls", guards.patched_globals(snapshot))
    blocked = sandbox.blocked_events()
    reasons += [f"sandbox: blocked {b}" for b in blocked[:3]]
    if device.startswith("cuda") and params.get("time_check") and not reasons:
        reasons += _floor_check(c, variant.run, params, checks)
    return {"reasons": reasons, "checks": checks, "per_shape": per_shape, "env": env}


def prepare_all(c: Any, shapes: list[dict], seeds: Sequence[int], device: str) -> list:
    """Trusted references for every (shape, seed). Every trial checks outputs and numerics; the
    first seed of each shape also checks determinism and pointer caching; the first trial also
    changes each input alone (input dependence). Fewer calls keep interpreted kernels fast."""
    from .trials import prepare

    return [prepare(c, shape, seed, device, first_seed=k == 0, dependence=(i == 0 and k == 0))
            for i, shape in enumerate(shapes) for k, seed in enumerate(seeds)]


def run_trials(c: Any, run: Any, prepared: list, params: dict) -> tuple[list[str], dict, list]:
    """All trials of one candidate callable, judged: (reasons, checks, per-shape records).

    In-process and unsandboxed: the verify job calls it inside the child; tests call it
    directly to exercise every op's contract (reference and near misses as candidates).
    """
    from .trials import TrialRunner

    device = params["device"]
    runner = TrialRunner(c, run, params.get("config"), device)
    for p in prepared:
        runner.trial(p)
    checks: dict[str, Any] = {}
    reasons = runner.findings.reasons()
    if not runner.per_shape and not reasons:
        reasons.append("no trial completed (no shapes or seeds given)")
    reasons += _judge_numerics(c, runner, device, checks)
    reasons += _judge_near_misses(runner, checks)
    checks["behaviour"] = {"calls": runner.calls, "failed": dict(runner.findings.count)}
    if c.name == "router":
        checks["router_ties"] = {"rows": runner.router_ties[:50],
                                 "tolerated": sum(r["tie"] for r in runner.router_ties)}
    return reasons, checks, runner.per_shape


def guard_methods(device: str) -> dict[str, str]:
    """How each behavioural guard was applied on this device (recorded in every report)."""
    cuda = device.startswith("cuda")
    return {
        "poison": ("caching allocator emptied, then blocks of every output size filled with NaN "
                   "(0xFF) and freed before each call" if cuda else
                   "glibc MALLOC_PERTURB_=128: fresh CPU memory reads 0x7F.., freed 0x80.."),
        "side_stream": ("outputs cloned on the current stream right after the call returns, "
                        "compared after a device-wide sync" if cuda else
                        "cpu: no streams; the static screen refuses stream APIs"),
        "bitwise_on_this_device": ("strict" if cuda else
                                   "ulp(1, 1e-3) for BF16 outputs, ulp(2, 0.5) without the bias "
                                   "test for FP32 outputs (Triton interpreter); strict on cuda"),
        "repeat_checks": "determinism and pointer caching at the first seed of every shape; "
                         "input dependence at the first trial",
        "references": "computed on input clones before the candidate is imported",
    }


def _patched(when: str, names: list[str]) -> list[str]:
    if not names:
        return []
    shown = ", ".join(names[:5]) + (f" (+{len(names) - 5} more)" if len(names) > 5 else "")
    return [f"monkeypatched {when}: {shown}"]


def _judge_numerics(c: Any, runner: Any, device: str, checks: dict) -> list[str]:
    from .numerics import effective_policy, judge

    reasons, outputs = [], []
    for i, (stats, dtype) in enumerate(zip(runner.stats, runner.output_dtypes, strict=True)):
        policy = effective_policy(c.numerics, dtype, device)
        failed = judge(policy, stats, f"output {i}")
        reasons += failed
        outputs.append({"policy": policy.describe(), "dtype": str(dtype), "passed": not failed,
                        **stats.to_dict()})
    checks["numerics"] = {"passed": bool(runner.stats) and not reasons, "outputs": outputs,
                          "contract": {"kind": c.numerics.kind, "max_ulp": c.numerics.max_ulp,
                                       "max_mismatch_fraction": c.numerics.max_mismatch_fraction}}
    return reasons


def _judge_near_misses(runner: Any, checks: dict) -> list[str]:
    reasons, table = [], {}
    for name, d in runner.near.items():
        if d["trials"] == 0:
            table[name] = {"status": "not run (the near miss failed on these shapes)"}
        elif d["near_ref"] == 0:
            table[name] = {"status": "not distinguishable on these inputs", **d}
        elif d["cand_ref"] < d["cand_near"]:
            table[name] = {"status": "closer to the reference", **d}
        else:
            table[name] = {"status": "closer to the near miss", **d}
            reasons.append(f"closer to near miss {name!r} than to the reference "
                           f"({d['cand_ref']} elements differ from the reference, "
                           f"{d['cand_near']} from the near miss)")
    checks["near_misses"] = {"passed": not reasons, "by_name": table}
    return reasons


def _floor_check(c: Any, run: Any, params: dict, checks: dict) -> list[str]:
    from .guards import floor_violation
    from .timing import floor_us, measure_ceilings, time_callable

    shape = max(params["shapes"], key=lambda s: c.cost(s).bytes)
    config = params.get("config")

    def sets(n: int) -> list[tuple]:
        return [c.make_inputs(shape, 100 + k, params["device"]) for k in range(n)]

    timing = time_callable(lambda *a: run(*a, config=config), sets, device=params["device"],
                           warmup=3, iters=20)
    ceilings = measure_ceilings(params["device"])
    floor = floor_us(c, shape, ceilings)
    why = floor_violation(timing.median_us, floor)
    checks["floor"] = {"passed": why is None, "shape": shape, "median_us": timing.median_us,
                       "floor_us": floor, "gpu": ceilings.gpu}
    return [why] if why else []


def run_env(device: str) -> dict[str, Any]:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover
        triton_version = None
    gpu = torch.cuda.get_device_name() if device.startswith("cuda") else None
    return {"torch": torch.__version__, "triton": triton_version, "gpu": gpu,
            "python": platform.python_version(), "device": device}
