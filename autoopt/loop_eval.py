"""The harness side of an optimize session: evaluate each proposal and register winners.

`HarnessEvaluator.evaluate` writes the proposal to the run directory, verifies it in the
sandbox (`autoopt.eval.verify`, once per distinct config it would run with), times it against the
reference and the current selection (`autoopt.eval.timing.bench_op`, sandboxed), records the
attempt (checkpointed by the loop) and, when it wins, registers it as a new immutable variant
with its record, tuned configs and a NOTES.md entry.

When a verified candidate wins (the rule the report states):
- On a GPU, its speedup over the current selection (geometric mean over the bench shapes: one
  per token bucket the target serves) must exceed 1 + max(MIN_GAIN, the timing noise: candidate
  and baseline IQR/median added). It becomes `candidate`, or `accepted` and locked for this arch
  with --auto-accept.
- On the CPU (the Triton interpreter), timings cannot judge anything: nothing is timed, neither
  the tuning trials nor the candidate; every verified candidate is registered as a `candidate`
  (speed not judged), never accepted or locked, and the report says so.
Tuning trials of the built-in templates (the project's own code, not an agent's) are timed
in-process with the harness's `time_callable` (GPU only); everything an agent wrote runs only in
the sandbox. A verification's child process is bounded by the op's deadline.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoopt.agents.base import Attempt, Feedback, OptimizationTask, Proposal

MIN_GAIN = 0.02  # 2%: below this a "win" is not worth a new variant even with tight timings
DEADLINE_GRACE_S = 15.0
_SLUG = re.compile(r"[^A-Za-z0-9_]+")


def slug(text: str, default: str = "v") -> str:
    s = _SLUG.sub("_", text).strip("_").lower()[:32]
    return s if s and not s[0].isdigit() else f"{default}_{s}" if s else default


def bucket(shape: Mapping[str, int]) -> str:
    return f"T={int(shape['T'])}"


@dataclass
class RunContext:
    """What every evaluation in one run shares."""

    run_dir: Path
    registry: Any  # model.registry.Registry
    target: Any  # autoopt.targets.Target
    arch: str  # "sm_90", "cpu": the lock section winners go to
    gpu: str  # the name tuned configs are keyed by
    auto_accept: bool = False
    proxy_note: str | None = None
    register: bool = True  # False for a replay: evaluate only
    verify_seeds: tuple[int, ...] = (0, 1, 2)
    verify_tokens: tuple[int, ...] = ()  # token counts of the verify shapes; () = eval defaults
    verify_timeout_s: float = 300.0
    compile: bool = False
    bench_warmup: int = 10
    bench_iters: int = 50
    tune_iters: int = 20
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def meaningful(self) -> bool:
        return self.arch != "cpu"


class HarnessEvaluator:
    """Evaluates the proposals of one op's session on one device (one worker)."""

    def __init__(self, ctx: RunContext, task: OptimizationTask, device: str,
                 bench_shapes: Sequence[Mapping[str, int]],
                 record: Callable[[str, Attempt, dict], None],
                 verify_shapes: Sequence[Mapping[str, int]] | None = None,
                 deadline: float | None = None, hard_deadline: float | None = None) -> None:
        self.ctx, self.task, self.device = ctx, task, device
        self.deadline, self.hard_deadline = deadline, hard_deadline
        self.bench_shapes = [dict(s) for s in bench_shapes]
        self.verify_shapes = [dict(s) for s in verify_shapes] if verify_shapes else None
        self.record = record
        self.op_dir = ctx.run_dir / "ops" / task.op
        self._baseline: list[dict] | None = None
        self._sets: dict[str, list[tuple]] = {}

    # ---- one proposal -----------------------------------------------------------------------
    def evaluate(self, proposal: Proposal, index: int | None = None) -> Feedback:
        index = index or len(self.task.attempts) + 1
        stem = f"a{index:02d}_{slug(proposal.name_hint)}"
        cand_dir = self.op_dir / "candidates"
        cand_dir.mkdir(parents=True, exist_ok=True)
        path = cand_dir / f"{stem}.py"
        path.write_text(proposal.source)
        sha = self.ctx.registry.sha256(path)
        agent = str(proposal.meta.get("agent", ""))
        timings: tuple[dict, ...] = ()
        speedup, outcome, detail = None, "", ""
        try:
            reasons, reports = self._verify(path, proposal)
            (cand_dir / f"{stem}.verify.json").write_text(json.dumps(reports, default=str))
            verdict = "reject" if reasons else "pass"
            if verdict == "pass" and self.ctx.meaningful:
                timings, speedup, bench_rows = self._bench(path, proposal)
                outcome = self._decide(path, proposal, sha, reports, bench_rows, timings,
                                       speedup)
            elif verdict == "pass":  # CPU: verified only; nothing is timed
                outcome = self._decide(path, proposal, sha, reports, [], (), None)
            else:
                detail = _reject_detail(reports)
        except Exception as e:  # noqa: BLE001 - a harness failure is recorded, never fatal
            verdict, reasons = "error", [f"harness error: {type(e).__name__}: {e}"]
        attempt = Attempt(index=index, op=self.task.op, candidate=stem, sha256=sha,
                          verdict=verdict, reasons=tuple(reasons), timings=timings,
                          speedup=speedup, meaningful=self.ctx.meaningful, outcome=outcome,
                          agent=agent, notes=proposal.notes)
        self.record(self.task.op, attempt, {**proposal.to_dict(), "file": str(path)})
        return Feedback(attempt, detail)

    def _configs_to_verify(self, proposal: Proposal) -> list[dict | None]:
        if proposal.configs:
            distinct: list[dict | None] = []
            for cfg in proposal.configs.values():
                if dict(cfg) not in distinct:
                    distinct.append(dict(cfg))
            return distinct
        return [dict(proposal.config) if proposal.config else None]

    def _verify(self, path: Path, proposal: Proposal) -> tuple[list[str], list[dict]]:
        from autoopt.eval.shapes import default_shapes
        from autoopt.eval.verify import verify_variant

        tokens = self.ctx.verify_tokens or None
        shapes = self.verify_shapes or _merge(default_shapes(self.task.op, self.device, tokens),
                                              self.bench_shapes)
        reasons, reports = [], []
        configs = self._configs_to_verify(proposal)
        for cfg in configs:
            rep = verify_variant(self.task.op, path, device=self.device,
                                 seeds=self.ctx.verify_seeds, shapes=shapes, config=cfg,
                                 timeout_s=self.timeout_s())
            reports.append(rep.to_dict())
            if not rep.passed:
                where = f"with config {cfg}: " if len(configs) > 1 else ""
                reasons += [where + r for r in rep.reasons]
                break  # the first failing config is enough evidence
        return reasons, reports

    def timeout_s(self) -> float:
        """A verification child's limit: the run's, cut at the op's deadline plus a grace (a
        candidate started just in time may finish), never past the sessions' end; >= 5 s."""
        limit = self.ctx.verify_timeout_s
        now = time.monotonic()
        if self.deadline is not None:
            limit = min(limit, self.deadline - now + DEADLINE_GRACE_S)
        if self.hard_deadline is not None:
            limit = min(limit, self.hard_deadline - now)
        return max(5.0, limit)

    # ---- timing -------------------------------------------------------------------------------
    def _bench_variant(self, path: Path, per_bucket: Mapping[str, Mapping | None]) -> list[dict]:
        from autoopt.eval.timing import bench_op

        groups: dict[str, list[dict]] = {}
        for shape in self.bench_shapes:
            cfg = per_bucket.get(bucket(shape))
            groups.setdefault(json.dumps(cfg, sort_keys=True), []).append(shape)
        rows = []
        for key, shapes in groups.items():
            cfg = json.loads(key)
            for row in bench_op(self.task.op, path, shapes, self.device, compile=self.ctx.compile,
                                config=cfg, warmup=self.ctx.bench_warmup,
                                iters=self.ctx.bench_iters):
                rows.append({**row.to_dict(), "config": cfg})
        order = [json.dumps(s, sort_keys=True) for s in self.bench_shapes]
        return sorted(rows, key=lambda r: order.index(json.dumps(r["shape"], sort_keys=True)))

    def _per_bucket(self, proposal: Proposal) -> dict[str, Mapping | None]:
        out = {}
        for shape in self.bench_shapes:
            b = bucket(shape)
            out[b] = (proposal.configs or {}).get(b) or proposal.config
        return out

    def baseline(self) -> list[dict]:
        """Timings of the current selection at the bench shapes (the reference's when none)."""
        if self._baseline is None:
            name = self.task.current_name
            if name == "reference":
                self._baseline = []
            else:
                from model.registry.configs import fixed_dims

                reg, op = self.ctx.registry, self.task.op
                tuned = reg.read_configs(op, name)
                path = reg.variant_path(op, name)
                per = {bucket(s): tuned.lookup(self.ctx.gpu, fixed_dims(op, s), int(s["T"]))
                       for s in self.bench_shapes}
                self._baseline = self._bench_variant(path, per)
        return self._baseline

    def _bench(self, path: Path, proposal: Proposal) -> tuple[tuple[dict, ...], float, list]:
        rows = self._bench_variant(path, self._per_bucket(proposal))
        base = self.baseline()
        timings, ratios, noise = [], [], []
        for k, row in enumerate(rows):
            b = base[k] if k < len(base) else None
            base_us = b["median_us"] if b else row["reference_us"]
            base_iqr = b["iqr_us"] if b else 0.0
            ratios.append(base_us / max(row["median_us"], 1e-9))
            noise.append(row["iqr_us"] / max(row["median_us"], 1e-9)
                         + base_iqr / max(base_us, 1e-9))
            timings.append({"shape": row["shape"], "median_us": row["median_us"],
                            "iqr_us": row["iqr_us"], "reference_us": row["reference_us"],
                            "baseline_us": base_us, "baseline": self.task.current_name,
                            "x_reference": row["x_reference"], "x_compile": row["x_compile"],
                            "pct_of_floor": row["pct_of_floor"], "floor_ok": row["floor_ok"],
                            "config": row.get("config"), "noise": noise[-1]})
        speedup = math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if ratios else 0.0
        return tuple(timings), speedup, rows

    def time_configs(self, proposal: Proposal, configs: Sequence[Mapping[str, Any]],
                     shape: Mapping[str, int]) -> list[float | None]:
        """In-process timing for template tuning (trusted, built-in template code only)."""
        from autoopt.eval.candidates import load_variant
        from autoopt.eval.timing import time_callable
        from model.ops import contract

        if proposal.meta.get("agent") != "template":
            raise PermissionError("in-process config timing is only for the built-in templates; "
                                  "an agent's code runs in the sandbox")
        if not self.ctx.meaningful:
            # The Triton interpreter's times say nothing about a config: none is timed, every
            # trial is a failed one, and the template keeps its default config.
            return [None] * len(configs)
        tune = self.op_dir / "tuning"
        tune.mkdir(parents=True, exist_ok=True)
        path = tune / f"{slug(proposal.name_hint)}.py"
        if not path.is_file() or path.read_text() != proposal.source:
            path.write_text(proposal.source)
        variant = load_variant(path)
        sets = self._input_sets(contract(self.task.op), shape)
        out: list[float | None] = []
        for cfg in configs:
            try:
                t = time_callable(lambda *a, cfg=dict(cfg): variant.run(*a, config=cfg), sets,
                                  device=self.device, warmup=2, iters=self.ctx.tune_iters)
                out.append(t.median_us)
            except Exception:  # noqa: BLE001 - a config that does not run is a failed trial
                out.append(None)
        return out

    def _input_sets(self, c: Any, shape: Mapping[str, int]) -> list[tuple]:
        """Rotating input sets for one shape, made once and reused by every trial there."""
        from autoopt.eval.timing import H200_L2_BYTES, sets_needed, tensor_bytes

        key = json.dumps(dict(shape), sort_keys=True)
        if key not in self._sets:
            first = c.make_inputs(dict(shape), 1000, self.device)
            n = sets_needed(tensor_bytes(first), H200_L2_BYTES) if self.ctx.meaningful else 1
            self._sets[key] = [first] + [c.make_inputs(dict(shape), 1000 + k, self.device)
                                         for k in range(1, n)]
        return self._sets[key]

    # ---- the decision -------------------------------------------------------------------------
    def _decide(self, path: Path, proposal: Proposal, sha: str, reports: list[dict],
                rows: list[dict], timings: Sequence[dict], speedup: float | None) -> str:
        impossible = [r for r in rows if not r.get("floor_ok", True) and self.ctx.meaningful]
        if impossible:
            return f"not registered: faster than the floor at {impossible[0]['shape']} (void)"
        if self.ctx.meaningful and speedup is not None:
            need = 1.0 + max(MIN_GAIN, max((t["noise"] for t in timings), default=0.0))
            if speedup <= need:
                return (f"verified, not registered: {speedup:.3f}x over {self.task.current_name}"
                        f" does not beat the noise threshold {need:.3f}x")
        if not self.ctx.register:
            return "verified (replay: registry untouched)"
        from autoopt.review import register_variant

        return register_variant(self.ctx, self.task, path, proposal, sha, reports, rows,
                                speedup)


def _merge(a: Sequence[Mapping], b: Sequence[Mapping]) -> list[dict]:
    out: list[dict] = []
    for s in [*a, *b]:
        if dict(s) not in out:
            out.append(dict(s))
    return out


def _reject_detail(reports: list[dict]) -> str:
    """A short pointer into the failing report's checks (the reasons carry the verdict)."""
    if not reports:
        return ""
    failed = [k for k, v in reports[-1].get("checks", {}).items()
              if isinstance(v, dict) and v.get("passed") is False]
    return f"failed checks: {', '.join(failed)}" if failed else ""


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")
