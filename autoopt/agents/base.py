"""The agent protocol: an agent reads an optimization task and proposes kernel variants.

Agents only propose. The harness (`autoopt.eval`, driven by the loop's `Evaluator`) alone
verifies and times every proposal, and its verdict comes back to the agent as `Feedback`, so an
agent can learn from a rejection but never decide one. A `Session` is one agent's conversation
about one op: `propose(feedback)` returns the next proposal (or None when the agent is done),
receiving the harness's verdict on the previous one. The Claude agent maps this onto a tool-use
loop (each `submit_variant` call is a proposal, its tool result is the feedback); the template
agent maps it onto its catalog and an Optuna search.
"""

from __future__ import annotations

import inspect
import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

PROMPTS = Path(__file__).parent / "prompts"
TEMPLATES = Path(__file__).parent / "templates"


def numerics_notes() -> str:
    """The numerics policy text shipped with the package (a copy of docs/numerics.md)."""
    return (PROMPTS / "numerics.md").read_text()


@dataclass(frozen=True)
class Attempt:
    """One evaluated proposal, as the harness judged it."""

    index: int  # 1-based, per op, in order of evaluation
    op: str
    candidate: str  # the candidate's file stem in the run directory
    sha256: str
    verdict: str  # "pass" | "reject" | "error" (the harness could not evaluate it)
    reasons: tuple[str, ...] = ()
    # Per shape: {"shape", "median_us", "iqr_us", "reference_us", "baseline_us", ...}
    timings: tuple[dict, ...] = ()
    speedup: float | None = None  # baseline time / candidate time (geometric mean over shapes)
    meaningful: bool = False  # timings from a GPU (CPU times say nothing about speed)
    outcome: str = ""  # "registered <name>", "not faster than <baseline>", ...
    agent: str = ""
    notes: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Attempt:
        d = dict(d)
        d["reasons"] = tuple(d.get("reasons", ()))
        d["timings"] = tuple(d.get("timings", ()))
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    def summary(self) -> str:
        """The verdict with its reasons, or per shape: time, baseline, speedup, share of floor."""
        head = f"attempt {self.index} ({self.candidate}): {self.verdict}"
        if self.verdict != "pass":
            return head + "".join(f"\n  - {r}" for r in self.reasons[:8])
        lines = [head + (f", speedup {self.speedup:.3f}x (geometric mean over the shapes)"
                         if self.speedup else "")]
        if not self.meaningful:
            lines.append("  (CPU: verified only, nothing timed; speed is judged on a GPU)")
        for t in self.timings[:12]:
            base = t.get("baseline_us")
            ratio = base / t["median_us"] if base and t.get("median_us") else None
            lines.append(
                f"  shape {t.get('shape')}: {_us(t.get('median_us'))} +- {_us(t.get('iqr_us'))}"
                f" (baseline {t.get('baseline', 'reference')} {_us(base)}, reference "
                f"{_us(t.get('reference_us'))}; {_x(ratio)} over the baseline, "
                f"{_pct(t.get('pct_of_floor'))} of the floor's speed)")
        if self.outcome:
            lines.append(f"  outcome: {self.outcome}")
        return "\n".join(lines)


def _us(v: Any) -> str:
    return "-" if v is None else f"{float(v):.2f} us"


def _x(v: Any) -> str:
    return "-" if v is None else f"{float(v):.3f}x"


def _pct(v: Any) -> str:
    return "-" if v is None else f"{float(v):.0f}%"


@dataclass(frozen=True)
class Proposal:
    """A variant source the agent asks the harness to evaluate."""

    source: str
    name_hint: str = "v"
    config_space: Mapping[str, list] = field(default_factory=dict)
    notes: str = ""  # hypothesis -> prediction, for NOTES.md
    config: Mapping[str, Any] | None = None  # one config for every shape
    configs: Mapping[str, Mapping[str, Any]] | None = None  # tuned: shape bucket -> config
    parent: str | None = None  # variant it derives from
    meta: Mapping[str, Any] = field(default_factory=dict)  # model, prompt hash, template, ...
    language: str | None = None  # declared by the submission; must match the file's LANGUAGE
    # The project's own code (a built-in template), which the harness may time in-process on a
    # worker to tune it; an agent that passes on model-written code never sets it.
    trusted: bool = False

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("source")
        return d


@dataclass(frozen=True)
class Feedback:
    """The harness's answer to one proposal."""

    attempt: Attempt
    detail: str = ""  # extra text (a shortened verification report)

    def to_text(self) -> str:
        return self.attempt.summary() + (f"\n{self.detail}" if self.detail else "")


@dataclass
class OptimizationTask:
    """Everything an agent may read about one op on one target."""

    op: str
    signature: str
    contract_doc: str  # the op module's docstring
    reference_source: str  # inspect.getsource of the op module: the single source of truth
    numerics_policy: str  # the op's policy in words
    hardware: dict
    shapes: list[dict]
    device: str
    current_name: str = "reference"
    current_source: str = ""
    current_record: dict = field(default_factory=dict)
    profile_row: dict = field(default_factory=dict)
    floor_us: float | None = None
    attempts: list[Attempt] = field(default_factory=list)
    # Sessions of one op run on threads and share the attempts; claims keep them within limits.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    _claimed: int = field(default=-1, repr=False, compare=False)

    def claim(self, limit: int) -> bool:
        """Reserve one of the op's `limit` proposals (attempts already made count)."""
        with self._lock:
            if self._claimed < 0:
                self._claimed = len(self.attempts)
            if self._claimed >= limit:
                return False
            self._claimed += 1
            return True

    def release(self) -> None:
        """Give back a claim that made no proposal."""
        with self._lock:
            self._claimed -= 1

    def add_attempt(self, attempt: Attempt) -> None:
        with self._lock:
            self.attempts.append(attempt)

    @classmethod
    def build(cls, op: str, *, hardware: Mapping[str, Any], shapes: Sequence[Mapping],
              device: str, current_name: str = "reference", current_source: str = "",
              current_record: Mapping | None = None, profile_row: Mapping | None = None,
              floor_us: float | None = None,
              attempts: Sequence[Attempt] = ()) -> OptimizationTask:
        from model.ops import contract

        c = contract(op)
        return cls(op=op, signature=c.signature, contract_doc=inspect.getdoc(c.module) or "",
                   reference_source=inspect.getsource(c.module),
                   numerics_policy=describe_numerics(c.numerics), hardware=dict(hardware),
                   shapes=[dict(s) for s in shapes], device=device, current_name=current_name,
                   current_source=current_source or inspect.getsource(c.module),
                   current_record=dict(current_record or {}),
                   profile_row=dict(profile_row or {}), floor_us=floor_us,
                   attempts=list(attempts))

    def contract_text(self) -> str:
        return (f"{self.signature}\n\n{self.contract_doc}\n\nNumerics policy: "
                f"{self.numerics_policy}\nShapes to serve (per rank): {json.dumps(self.shapes)}\n"
                f"Device: {self.device}; hardware: {json.dumps(self.hardware)}")

    def profile_text(self) -> str:
        if not self.profile_row:
            return "no profile row for this op"
        return (f"profile row: {json.dumps(self.profile_row)}\nfloor: {self.floor_us} us "
                f"(time above the floor is what can be won)")

    def history_text(self) -> str:
        if not self.attempts:
            return "no earlier attempts"
        return "\n".join(a.summary() for a in self.attempts)


def describe_numerics(numerics: Any) -> str:
    if numerics.kind == "bitwise":
        text = "bitwise: every output element identical to the reference"
    else:
        text = (f"ulp: at most {numerics.max_ulp} BF16 ulp and a mismatch fraction of at most "
                f"{numerics.max_mismatch_fraction:g}, no bias in the signed error")
    near = ", ".join(numerics.near_misses) or "none"
    text += (f"; must be strictly closer to the reference than to each near miss ({near})")
    return text + (f"; note: {numerics.note}" if numerics.note else "")


class Evaluator(Protocol):
    """The harness side of a session (implemented by the loop)."""

    def evaluate(self, proposal: Proposal) -> Feedback:
        """Write, verify (sandboxed), time and record the proposal; register a winner."""

    def time_configs(self, proposal: Proposal, configs: Sequence[Mapping[str, Any]],
                     shape: Mapping[str, int]) -> list[float | None]:
        """Harness timing (median µs) of a trusted proposal's source under each config at one
        shape; None where a config fails to run (or nothing is timed, on a CPU)."""

    def check(self, proposal: Proposal, shape: Mapping[str, int] | None = None) -> str:
        """Compile and run one small shape against the reference; the first mismatches or the
        compiler's error, as text. Not a submission: nothing is recorded."""

    def profile(self, proposal: Proposal) -> str:
        """Nsight Compute metrics of a verified proposal's kernels at the bench shapes, as text
        (a plain message where there is no GPU or no ncu)."""


class Session(Protocol):
    """One agent's conversation about one op."""

    def propose(self, feedback: Feedback | None) -> Proposal | None:
        """The next proposal, given the harness's verdict on the previous one (None at first).
        None means the agent is done."""

    def close(self) -> dict:
        """End the session; returns its summary (stop reason, usage, cost)."""


@dataclass(frozen=True)
class Limits:
    """What one session may spend; the loop checks these between proposals."""

    max_candidates: int = 4  # per session
    deadline: float | None = None  # time.monotonic() value
    op_candidates: int | None = None  # all sessions of the op together (None: max_candidates)
    # Seconds one candidate's evaluation (verification and timing) is expected to take here:
    # what a session's own searching (a template's config trials) must leave before its deadline.
    eval_s: float = 0.0

    def __post_init__(self) -> None:
        if self.max_candidates < 1 or (self.op_candidates is not None
                                       and self.op_candidates < 1):
            raise ValueError("max_candidates and op_candidates must be >= 1")
        if not self.eval_s >= 0:
            raise ValueError(f"eval_s must be seconds >= 0, got {self.eval_s}")


class UsageSink(Protocol):
    """Where sessions report what they spend (the run's ledger, autoopt/budget.py)."""

    def api_call(self, session: str, model: str, usage: Mapping[str, Any], usd: float) -> None:
        ...

    def usd(self) -> float:
        ...


@dataclass(frozen=True)
class SessionContext:
    """Which of an op's sessions this is: sessions of one op differ by seed or strategy."""

    index: int = 0
    count: int = 1
    seed: int = 0
    name: str = "s0"  # the session's key in the run's accounting
    ledger: UsageSink | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.count:
            raise ValueError(f"session index {self.index} is outside 0..{self.count - 1}")


class Agent(Protocol):
    name: str

    def supports(self, op: str) -> bool:
        """Whether this agent can propose anything for `op`."""

    def start(self, task: OptimizationTask, evaluator: Evaluator, workdir: Path,
              limits: Limits, context: SessionContext | None = None) -> Session:
        """Open a session for `task`; `workdir` is this session's directory in the run dir."""


@dataclass
class SessionResult:
    op: str
    agent: str
    attempts: list[Attempt]
    stop_reason: str
    summary: dict = field(default_factory=dict)


def run_session(agent: Agent, task: OptimizationTask, evaluator: Evaluator, workdir: Path,
                limits: Limits, clock: Any = None,
                context: SessionContext | None = None) -> SessionResult:
    """Drive one session: propose, evaluate, feed the verdict back, until done or out of budget.
    Several sessions of one op may run at once on threads, sharing `task` and `evaluator`."""
    import time

    now = clock or time.monotonic
    context = context or SessionContext()
    session = agent.start(task, evaluator, workdir, limits, context)
    feedback: Feedback | None = None
    made: list[Attempt] = []
    stop = "agent finished"
    op_limit = limits.op_candidates or limits.max_candidates
    try:
        while True:
            if len(made) >= limits.max_candidates:
                stop = f"max candidates ({limits.max_candidates}) reached"
                break
            if limits.deadline is not None and now() >= limits.deadline:
                stop = "time budget spent"
                break
            if not task.claim(op_limit):
                stop = f"max candidates for the op ({op_limit}) reached"
                break
            proposal = session.propose(feedback)
            if proposal is None:
                task.release()
                break
            feedback = evaluator.evaluate(proposal)
            task.add_attempt(feedback.attempt)
            made.append(feedback.attempt)
    finally:
        summary = session.close() or {}
    stop = summary.get("stop_reason") or stop
    return SessionResult(task.op, agent.name, made, stop, summary)
