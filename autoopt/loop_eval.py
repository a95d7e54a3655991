"""The harness side of an optimize session: evaluate each proposal and register winners.

`HarnessEvaluator.evaluate` writes the proposal to the run directory and sends an `EvalJob` to
the run's evaluation farm (autoopt/farm: a thread here, a worker process per GPU, or a Ray task
on one GPU): the job verifies the candidate in the sandbox (`autoopt.eval.verify`, once per
distinct config it would run with; a CuTe DSL submission is compiled by the registry's CuTe
check first) and, on a GPU, times it and the current selection back to back on that GPU
(`autoopt.eval.bench.bench_op`). The verdict, the decision and every registry write happen
here, in the head: the attempt is recorded (checkpointed by the loop) and, when it wins,
registered as a new immutable variant with its record, tuned configs and a NOTES.md entry.
Several sessions of one op share an evaluator (threads); attempt numbers are handed out under
a lock. The tools of the Claude agent go the same way: `check` (one small shape against the
reference) and `profile` (Nsight Compute metrics of a verified candidate) are jobs too, and
`read_variant` reads the registry.

When a verified candidate wins (the rule the report states):
- On a GPU, its speedup over the current selection (geometric mean over the bench shapes: one
  per token bucket the target serves) must exceed 1 + max(MIN_GAIN, the timing noise: candidate
  and baseline IQR/median added). It becomes `candidate`, or `accepted` and locked for this arch
  with --auto-accept.
- On the CPU (the Triton interpreter), timings cannot judge anything: nothing is timed, neither
  the tuning trials nor the candidate; every verified candidate is registered as a `candidate`
  (speed not judged), never accepted or locked, and the report says so.
Tuning trials of trusted proposals (the built-in templates: the project's own code, not an
agent's) are timed in-process on a worker with the harness's `time_callable` (GPU only);
everything an agent wrote runs only in the sandbox. An evaluation (verification, then the
candidate's and the baseline's timings) is bounded as a whole by the op's deadline plus a grace;
a candidate verified too late to be timed is reported untimed and not registered.
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
from autoopt.farm.jobs import CheckJob, EvalJob, ProfileJob, TuneJob, bucket
from autoopt.runlog import say

MIN_GAIN = 0.02  # 2%: below this a "win" is not worth a new variant even with tight timings
PENDING = ".pending.json"  # beside a candidate whose evaluation is not yet recorded
MAX_RESUMES = 1  # a pending evaluation is tried again this many times after interruptions
DEADLINE_GRACE_S = 15.0
_SLUG = re.compile(r"[^A-Za-z0-9_]+")


def slug(text: str, default: str = "v") -> str:
    s = _SLUG.sub("_", text).strip("_").lower()[:32]
    return s if s and not s[0].isdigit() else f"{default}_{s}" if s else default


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
    # Set when the run is being stopped (Ctrl-C, SIGTERM): an evaluation that fails then (its
    # farm closing) is left pending for --resume, not recorded as the candidate's error.
    stopping: threading.Event = field(default_factory=threading.Event)

    @property
    def meaningful(self) -> bool:
        return self.arch != "cpu"


class HarnessEvaluator:
    """Evaluates the proposals of one op's sessions on the run's farm."""

    def __init__(self, ctx: RunContext, task: OptimizationTask, device: str,
                 bench_shapes: Sequence[Mapping[str, int]],
                 record: Callable[[str, Attempt, dict], None],
                 verify_shapes: Sequence[Mapping[str, int]] | None = None,
                 deadline: float | None = None, hard_deadline: float | None = None,
                 farm: Any = None, ledger: Any = None) -> None:
        self.ctx, self.task, self.device = ctx, task, device
        self.deadline, self.hard_deadline = deadline, hard_deadline
        self.bench_shapes = [dict(s) for s in bench_shapes]
        self.verify_shapes = [dict(s) for s in verify_shapes] if verify_shapes else None
        self.record = record
        self.op_dir = ctx.run_dir / "ops" / task.op
        if farm is None:
            from autoopt.farm.local import InlineFarm

            farm = InlineFarm(device)
        self.farm, self.ledger = farm, ledger
        self._base: tuple[str | None, dict] | None = None
        # What the baseline is called: the lock's variant, "reference", or for a composite op
        # without a variant of its own the composition of its locked parts.
        self.baseline_name, self.baseline_label = task.current_name, task.current_name
        self._lock = threading.Lock()
        self._issued = 0

    # ---- one proposal -----------------------------------------------------------------------
    def _index(self, index: int | None) -> int:
        with self._lock:
            self._issued = max(self._issued, len(self.task.attempts))
            if index is None:
                self._issued += 1
                return self._issued
            self._issued = max(self._issued, index)
            return index

    def evaluate(self, proposal: Proposal, index: int | None = None, *,
                 resumes: int = 0) -> Feedback:
        """Verify (and on a GPU time) one proposal, record its attempt, register a winner. Until
        it is recorded the proposal stays on disk as pending (`resume_pending`)."""
        index = self._index(index)
        stem = f"a{index:02d}_{slug(proposal.name_hint)}"
        cand_dir = self.op_dir / "candidates"
        cand_dir.mkdir(parents=True, exist_ok=True)
        path = cand_dir / f"{stem}.py"
        path.write_text(proposal.source)
        pending = cand_dir / f"{stem}{PENDING}"
        _write_json(pending, {"index": index, "candidate": stem, "resumes": resumes,
                              "proposal": proposal.to_dict()})
        sha = self.ctx.registry.sha256(path)
        timings: tuple[dict, ...] = ()
        speedup, outcome, detail = None, "", ""
        try:
            lang, why = self.language(proposal)
            res = ({"reasons": [why], "reports": [], "rows": [], "baseline_rows": []} if why
                   else self._run(self._eval_job(stem, proposal, lang)))
            reasons, reports = list(res["reasons"]), res["reports"]
            (cand_dir / f"{stem}.verify.json").write_text(json.dumps(reports, default=str))
            verdict = "reject" if reasons else "pass"
            if res.get("unjudged"):
                # The op's deadline cut a verification short: no verdict on the candidate.
                verdict, reasons = "error", [res["unjudged"]]
                outcome = "not registered: unjudged"
            elif verdict == "pass" and self.ctx.meaningful and res.get("untimed"):
                # Verified, but the op's deadline came before its timing: no speed, no decision.
                outcome = f"verified, not registered: {res['untimed']}"
            elif verdict == "pass" and self.ctx.meaningful:
                timings, speedup = self._timings(res["rows"], res["baseline_rows"])
                outcome = self._decide(path, proposal, sha, reports, res["rows"], timings,
                                       speedup)
            elif verdict == "pass":  # CPU: verified only; nothing is timed
                outcome = self._decide(path, proposal, sha, reports, [], (), None)
            else:
                detail = _reject_detail(reports)
        except Exception as e:  # noqa: BLE001 - a harness failure is recorded, never fatal
            if self.ctx.stopping.is_set():
                raise  # the run is stopping: the proposal stays pending
            verdict, reasons = "error", [f"harness error: {type(e).__name__}: {e}"]
        attempt = self._record(proposal, index, path, sha, verdict, reasons, timings=timings,
                               speedup=speedup, outcome=outcome)
        pending.unlink(missing_ok=True)
        return Feedback(attempt, detail)

    def _record(self, proposal: Proposal, index: int, path: Path, sha: str, verdict: str,
                reasons, *, timings: tuple[dict, ...] = (), speedup: float | None = None,
                outcome: str = "") -> Attempt:
        """The proposal's attempt, recorded with the proposal and its candidate file."""
        attempt = Attempt(index=index, op=self.task.op, candidate=path.stem, sha256=sha,
                          verdict=verdict, reasons=tuple(reasons), timings=timings,
                          speedup=speedup, meaningful=self.ctx.meaningful, outcome=outcome,
                          agent=str(proposal.meta.get("agent", "")), notes=proposal.notes)
        self.record(self.task.op, attempt, {**proposal.to_dict(), "file": str(path)})
        return attempt

    def resume_pending(self) -> list[Feedback]:
        """Evaluate the proposals an interrupted run left unjudged (its evaluation in flight when
        the process was killed), with their numbers, before any agent proposes again: the agent's
        work (a model's tokens, a template's tuning) is not lost with the evaluation. One
        interrupted again is recorded as an error and not tried a third time: it may be what
        brings the run down."""
        entries = []
        for path in (self.op_dir / "candidates").glob(f"*{PENDING}"):
            try:
                entry = json.loads(path.read_text())
                index, stem = int(entry["index"]), str(entry["candidate"])
                resumes, fields = int(entry.get("resumes", 0)), dict(entry["proposal"])
                source = (path.parent / f"{stem}.py").read_text()
            except (OSError, ValueError, KeyError, TypeError) as e:
                say(f"  {self.task.op}: {path.name} is unreadable ({type(e).__name__}: {e}); "
                    "its proposal is not evaluated")
                path.unlink(missing_ok=True)
                continue
            entries.append((index, stem, resumes, fields, source, path))
        out = []
        for index, stem, resumes, fields, source, path in sorted(entries, key=lambda e: e[0]):
            if any(a.index == index for a in self.task.attempts):
                path.unlink(missing_ok=True)  # recorded just before the interruption
                continue
            # Never trusted from a file: in-process timing is for the templates' own tuning,
            # which is over; the sandboxed evaluation needs no trust.
            fields = {k: v for k, v in fields.items()
                      if k in Proposal.__dataclass_fields__ and k not in ("source", "trusted")}
            proposal = Proposal(source=source, **fields)
            if resumes >= MAX_RESUMES:
                fb = self._interrupted(proposal, index, path.parent / f"{stem}.py")
                path.unlink(missing_ok=True)
            else:
                say(f"  {self.task.op} #{index} {stem}: evaluating the proposal an interrupted "
                    "run left unjudged")
                fb = self.evaluate(proposal, index, resumes=resumes + 1)
            self.task.add_attempt(fb.attempt)
            out.append(fb)
        return out

    def _interrupted(self, proposal: Proposal, index: int, path: Path) -> Feedback:
        reason = (f"its evaluation was interrupted {MAX_RESUMES + 1} times (the run killed "
                  "while judging it): not evaluated again")
        return Feedback(self._record(proposal, self._index(index), path,
                                     self.ctx.registry.sha256(path), "error", (reason,),
                                     outcome="not registered: unjudged"))

    def language(self, proposal: Proposal) -> tuple[str, str | None]:
        """(the source's declared language, why it cannot be submitted as proposed or None)."""
        from autoopt.farm.languages import declared

        lang, err = declared(proposal.source)
        if err:
            return "triton", f"declarations: {err}"
        if proposal.language and proposal.language != lang:
            return lang, (f"submitted as {proposal.language} but the module declares LANGUAGE "
                          f"= {lang!r} (absent means triton): add `LANGUAGE = "
                          f"\"{proposal.language}\"` at its top level, or submit it as {lang}")
        return lang, None

    def _run(self, job: Any) -> dict:
        res = self.farm.submit(job).result()
        if self.ledger is not None:
            self.ledger.device_job(res.get("worker", "?"), res.get("kind", job.kind),
                                   res.get("device_s", 0.0))
        return res

    def _configs_to_verify(self, proposal: Proposal) -> list[dict | None]:
        if proposal.configs:
            distinct: list[dict | None] = []
            for cfg in proposal.configs.values():
                if dict(cfg) not in distinct:
                    distinct.append(dict(cfg))
            return distinct
        return [dict(proposal.config) if proposal.config else None]

    def _eval_job(self, stem: str, proposal: Proposal, language: str) -> EvalJob:
        base_source, base_per = self.baseline_spec() if self.ctx.meaningful else (None, {})
        return EvalJob(
            op=self.task.op, name=stem, source=proposal.source,
            configs=tuple(self._configs_to_verify(proposal)),
            per_bucket=self._per_bucket(proposal), bench_shapes=tuple(self.bench_shapes),
            verify_shapes=tuple(self.verify_shapes or ()),
            verify_seeds=len(self.ctx.verify_seeds), verify_tokens=tuple(self.ctx.verify_tokens),
            timed=self.ctx.meaningful, baseline_name=self.baseline_name,
            baseline_source=base_source, baseline_per_bucket=base_per, language=language,
            compile=self.ctx.compile, warmup=self.ctx.bench_warmup, iters=self.ctx.bench_iters,
            timeout_s=self.timeout_s(), budget_s=self.budget_s())

    def budget_s(self) -> float | None:
        """What an evaluation has in all (verification and both timings): until the op's
        deadline plus a grace (a candidate started just in time may finish), never past the
        sessions' end; None without either; >= 5 s."""
        now = time.monotonic()
        ends = [d for d in (None if self.deadline is None else self.deadline + DEADLINE_GRACE_S,
                            self.hard_deadline) if d is not None]
        return max(5.0, min(ends) - now) if ends else None

    def timeout_s(self) -> float:
        """One verification's (or timing's) limit: the run's, within `budget_s`; >= 5 s."""
        budget = self.budget_s()
        return max(5.0, min(self.ctx.verify_timeout_s, budget if budget is not None else
                            self.ctx.verify_timeout_s))

    # ---- timing -------------------------------------------------------------------------------
    def _per_bucket(self, proposal: Proposal) -> dict[str, Mapping | None]:
        out = {}
        for shape in self.bench_shapes:
            b = bucket(shape)
            out[b] = (proposal.configs or {}).get(b) or proposal.config
        return out

    def baseline_spec(self) -> tuple[str | None, dict]:
        """(source, per-bucket configs) of the current selection; (None, {}): the reference."""
        if self._base is None:
            name = self.task.current_name
            if name == "reference":
                self._base = self._composed_baseline()
            else:
                from model.registry.configs import fixed_dims

                reg, op = self.ctx.registry, self.task.op
                tuned = reg.read_configs(op, name)
                per = {bucket(s): tuned.lookup(self.ctx.gpu, fixed_dims(op, s), int(s["T"]))
                       for s in self.bench_shapes}
                self._base = (reg.read_variant(op, name)[1].decode(), per)
        return self._base

    def _composed_baseline(self) -> tuple[str | None, dict]:
        """A composite op without a variant of its own is served as its locked parts' composition:
        a fused candidate must beat that, not the reference (model/registry/composite.py)."""
        from model.registry.composite import composed_selection

        try:
            sel = composed_selection(self.ctx.registry, self.task.op, self.ctx.arch, self.ctx.gpu,
                                     self.bench_shapes)
        except ValueError as exc:
            from .runlog import logger

            logger().info("%s: the baseline is the reference: %s", self.task.op, exc)
            sel = None
        if sel is None:
            return None, {}
        self.baseline_name, self.baseline_label = "composed", sel.label
        return sel.source, dict(sel.per_bucket)

    def _timings(self, rows: list[dict], base: list[dict]) -> tuple[tuple[dict, ...], float]:
        timings, ratios = [], []
        for k, row in enumerate(rows):
            b = base[k] if k < len(base) else None
            base_us = b["median_us"] if b else row["reference_us"]
            base_iqr = b["iqr_us"] if b else 0.0
            ratios.append(base_us / max(row["median_us"], 1e-9))
            noise = (row["iqr_us"] / max(row["median_us"], 1e-9)
                     + base_iqr / max(base_us, 1e-9))
            timings.append({"shape": row["shape"], "median_us": row["median_us"],
                            "iqr_us": row["iqr_us"], "reference_us": row["reference_us"],
                            "baseline_us": base_us, "baseline": self.baseline_label,
                            "x_reference": row["x_reference"], "x_compile": row["x_compile"],
                            "pct_of_floor": row["pct_of_floor"], "floor_ok": row["floor_ok"],
                            "config": row.get("config"), "noise": noise})
        speedup = math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if ratios else 0.0
        return tuple(timings), speedup

    def time_configs(self, proposal: Proposal, configs: Sequence[Mapping[str, Any]],
                     shape: Mapping[str, int]) -> list[float | None]:
        """Timing of a trusted proposal's configs on a worker, in-process (template tuning)."""
        if not proposal.trusted:
            raise PermissionError("in-process config timing is only for trusted code (the "
                                  "built-in templates); an agent's code runs in the sandbox")
        if not self.ctx.meaningful:
            # The Triton interpreter's times say nothing about a config: none is timed, every
            # trial is a failed one, and the template keeps its default config.
            return [None] * len(configs)
        job = TuneJob(op=self.task.op, name=f"tune_{slug(proposal.name_hint)}",
                      source=proposal.source, configs=tuple(dict(c) for c in configs),
                      shape=dict(shape), iters=self.ctx.tune_iters)
        return list(self._run(job)["us"])

    # ---- the agent's tools --------------------------------------------------------------------
    def check(self, proposal: Proposal, shape: Mapping[str, int] | None = None) -> str:
        from autoopt.farm.check import format_check

        lang, why = self.language(proposal)
        if why:
            return f"not checked: {why}"
        shape = dict(shape) if shape else min(self.bench_shapes, key=lambda s: int(s["T"]))
        job = CheckJob(op=self.task.op, name=f"check_{slug(proposal.name_hint)}",
                       source=proposal.source, shape=shape, config=proposal.config,
                       language=lang, timeout_s=min(120.0, self.timeout_s()))
        return format_check(self._run(job))

    def profile(self, proposal: Proposal) -> str:
        from autoopt.farm.profile import format_profile

        job = ProfileJob(op=self.task.op, name=f"profile_{slug(proposal.name_hint)}",
                         source=proposal.source, shapes=tuple(self.bench_shapes),
                         per_bucket=self._per_bucket(proposal),
                         timeout_s=min(300.0, self.timeout_s()))
        return format_profile(self._run(job))

    def read_variant(self, op: str, name: str) -> tuple[str, bool]:
        reg = self.ctx.registry
        known = reg.variants(op) if (reg.root / op).is_dir() else []
        if name not in known:
            return (f"no registered variant {op}/{name}; {op} has: "
                    f"{', '.join(known) or 'none (its baseline is the reference)'}"), True
        _, data = reg.read_variant(op, name)
        rec = reg.read_record(op, name)
        record = json.dumps(rec.to_json(), indent=1, default=str)[:20_000] if rec else "none"
        return (f"{op}/{name} (status {rec.status if rec else 'unknown'})\n\n{data.decode()}"
                f"\n\nrecord:\n{record}"), False

    # ---- the decision -------------------------------------------------------------------------
    def _decide(self, path: Path, proposal: Proposal, sha: str, reports: list[dict],
                rows: list[dict], timings: Sequence[dict], speedup: float | None) -> str:
        impossible = [r for r in rows if not r.get("floor_ok", True) and self.ctx.meaningful]
        if impossible:
            return f"not registered: faster than the floor at {impossible[0]['shape']} (void)"
        if self.ctx.meaningful and speedup is not None:
            need = 1.0 + max(MIN_GAIN, max((t["noise"] for t in timings), default=0.0))
            if speedup <= need:
                return (f"verified, not registered: {speedup:.3f}x over {self.baseline_label}"
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


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, default=str))
    tmp.replace(path)  # atomic: a kill leaves the whole file or none


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S")
