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
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

PROMPTS = Path(__file__).parent / "prompts"
TEMPLATES = Path(__file__).parent / "templates"


def numerics_notes() -> str:
    """The numerics policy text shipped with the package (a copy of the project's NUMERICS.md)."""
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
        """A few lines for a prompt or a tool result."""
        head = f"attempt {self.index} ({self.candidate}): {self.verdict}"
        if self.verdict != "pass":
            return head + "".join(f"\n  - {r}" for r in self.reasons[:8])
        lines = [head + (f", speedup {self.speedup:.3f}x" if self.speedup else "")]
        if not self.meaningful:
            lines.append("  (CPU timings: not meaningful for speed)")
        for t in self.timings[:8]:
            lines.append(f"  shape {t.get('shape')}: {t.get('median_us', float('nan')):.2f} us "
                         f"(baseline {t.get('baseline_us', float('nan')):.2f} us)")
        if self.outcome:
            lines.append(f"  outcome: {self.outcome}")
        return "\n".join(lines)


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
        """Harness timing (median µs) of the proposal's source under each config at one shape;
        None where a config fails to run."""


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

    max_candidates: int = 4
    deadline: float | None = None  # time.monotonic() value


class Agent(Protocol):
    name: str

    def supports(self, op: str) -> bool:
        """Whether this agent can propose anything for `op`."""

    def start(self, task: OptimizationTask, evaluator: Evaluator, workdir: Path,
              limits: Limits) -> Session:
        """Open a session for `task`; `workdir` is this op's directory in the run dir."""


@dataclass
class SessionResult:
    op: str
    agent: str
    attempts: list[Attempt]
    stop_reason: str
    summary: dict = field(default_factory=dict)


def run_session(agent: Agent, task: OptimizationTask, evaluator: Evaluator, workdir: Path,
                limits: Limits, clock: Any = None) -> SessionResult:
    """Drive one session: propose, evaluate, feed the verdict back, until done or out of budget."""
    import time

    now = clock or time.monotonic
    session = agent.start(task, evaluator, workdir, limits)
    feedback: Feedback | None = None
    made: list[Attempt] = []
    stop = "agent finished"
    try:
        while True:
            if len(task.attempts) >= limits.max_candidates:
                stop = f"max candidates ({limits.max_candidates}) reached"
                break
            if limits.deadline is not None and now() >= limits.deadline:
                stop = "time budget spent"
                break
            proposal = session.propose(feedback)
            if proposal is None:
                break
            feedback = evaluator.evaluate(proposal)
            task.attempts.append(feedback.attempt)
            made.append(feedback.attempt)
    finally:
        summary = session.close() or {}
    stop = summary.get("stop_reason") or stop
    return SessionResult(task.op, agent.name, made, stop, summary)
