"""One verification's calls, in an order drawn from the run's secret.

The session makes one `Case` per (shape, seed) of the plan (buckets with several seeds, drawn and
long token counts, edge cases, and a random number of filler calls), shuffles them, and inserts
follow-ups at random later points: repeats, same-buffer and one-element changes, input
replacement, shuffled program order (CPU), rechecks of earlier outputs, one burst, and early on
a marathon (thousands of calls in a row, so that state counting calls is past any count a
candidate could expect a verifier to stop at before the judged calls after it). How many
calls a run makes, in which order and at which token counts differ from run to run, so a
candidate cannot count its way to the calls that are judged.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import followups as fu
from .plan import Budget, Secret, ShapePlan
from .trials import Case, Judge

_CPU_BURST_T = 3
_GPU_BURST_T = 64
_CPU_ORDER_T = 64


def build_steps(plan: ShapePlan, budget: Budget, secret: Secret) -> tuple[list, list[tuple]]:
    """(specs, steps): specs are (shape, seed, edge); steps refer to specs by index."""
    rng = secret.rng
    specs: list[tuple[dict, int, Any]] = [
        (s, secret.seed(), None) for s in plan.buckets
        for _ in range(budget.seeds if s.get("T", 0) <= budget.large_tokens else
                       min(budget.seeds, budget.large_seeds))]
    specs += [(s, secret.seed(), None) for s in plan.drawn + plan.long]
    specs += [(dict(e.shape), secret.seed(), e) for e in plan.edges]
    pool = plan.buckets + plan.drawn
    specs += [(rng.choice(pool), secret.seed(), None)
              for _ in range(rng.randint(*budget.filler))]
    rng.shuffle(specs)
    steps: list[tuple] = [("first", k) for k in range(len(specs))]
    plain = [k for k, (_, _, e) in enumerate(specs) if e is None]
    # Follow-ups go to cheap cases with several rows (a race between rows needs two).
    small = sorted(plain, key=lambda k: specs[k][0].get("T", 0))
    small = ([k for k in small if specs[k][0].get("T", 0) >= 2] or small)
    small = small[:max(2 * budget.follow_ups, 1)]
    chosen = rng.sample(small, min(budget.follow_ups, len(small)))
    for k in chosen:
        for kind in ("repeat", "same_buffers", "dependence", "one_element"):
            _insert_after(steps, ("first", k), (kind, k), rng)
    if plan.kind == "cpu":
        # Program order: on the case with the most rows the interpreter runs quickly (more
        # programs, more chances for an order-dependent write to show), and on a small one.
        cheap = [k for k in plain if 2 <= specs[k][0].get("T", 0) <= _CPU_ORDER_T]
        for k in {max(cheap, key=lambda m: specs[m][0]["T"], default=None), *chosen[:1]}:
            if k is not None:
                for kind in ("shuffled_random", "shuffled_reverse"):
                    _insert_after(steps, ("first", k), (kind, k), rng)
    def later_same(k: int) -> list[int]:
        return [m for m in plain if m != k and specs[m][0] == specs[k][0]
                and steps.index(("first", m)) > steps.index(("first", k))]

    # Rechecked: cases with a later first call at the same shape where there are such, so that a
    # buffer the op reuses per shape is overwritten by then (the last case of a shape has none).
    shared = [k for k in plain if later_same(k)]
    for k in rng.sample(shared or plain, min(budget.rechecks, len(shared or plain))):
        same = later_same(k)
        anchor = ("first", max(same, key=lambda m: steps.index(("first", m)))) if same else \
            ("first", k)
        _insert_after(steps, anchor, ("recheck", k), rng, gap=0 if same else 1)
    limit = _CPU_BURST_T if plan.kind == "cpu" else _GPU_BURST_T
    burst_shapes = [s for s in plan.buckets if 1 <= s.get("T", 0) <= limit] or plan.buckets[:1]
    if burst_shapes:
        steps.insert(rng.randint(0, len(steps)), ("burst", rng.choice(burst_shapes)))
    if budget.marathon_s[1] > 0 and burst_shapes:
        # Before one of the first third of the cases' first calls: two thirds come after it.
        firsts = [k for k, (kind, _) in enumerate(steps) if kind == "first"]
        at = firsts[rng.randint(0, len(firsts) // 3)] if firsts else 0
        steps.insert(at, ("marathon", rng.choice(burst_shapes)))
    # What the candidate keeps between calls, on the follow-up cases and on the cases with the
    # fewest and the most tokens (a count kept only for decode or only for prefill calls),
    # after every other step: it needs no secret position, a count changes on every call.
    if plain:
        # The most tokens among the buckets' cases: a drawn or long count past them costs four
        # more calls at the run's largest shape and shows nothing a bucket's would not.
        bucketed = [k for k in plain if specs[k][0] in plan.buckets] or plain
        ends = (min(plain, key=lambda k: specs[k][0].get("T", 0)),
                max(bucketed, key=lambda k: specs[k][0].get("T", 0)))
        for k in dict.fromkeys((*chosen, *ends)):
            steps.append(("state", k))
    return specs, steps


def _insert_after(steps: list, anchor: tuple, step: tuple, rng: Any, gap: int = 0) -> None:
    pos = steps.index(anchor) + 1 + gap
    steps.insert(rng.randint(min(pos, len(steps)), len(steps)), step)


def run_steps(j: Judge, specs: list, steps: list[tuple], budget: Budget,
              secret: Secret) -> dict[str, Any]:
    """Execute the steps; returns what the burst reported. WorkerError propagates."""
    run = _StepRun(j, specs, steps, budget, secret)
    for n, (kind, _) in enumerate(steps):
        t0 = time.perf_counter()
        try:
            run.step(n)
        finally:
            j.by_step[kind] = j.by_step.get(kind, 0.0) + time.perf_counter() - t0
    return run.burst_info


@dataclass
class _StepRun:
    """The state `run_steps` carries from step to step: each case's inputs and output handles,
    the last step that uses each case (its buffers are freed after it), and what the burst
    reported."""

    judge: Judge
    specs: list
    steps: list[tuple]
    budget: Budget
    secret: Secret
    cases: dict[int, Case | None] = field(default_factory=dict)
    last: dict[int, int] = field(default_factory=dict)
    needs_inputs: set[int] = field(default_factory=set)  # a later step calls on its inputs again
    burst_info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for n, (kind, arg) in enumerate(self.steps):
            if isinstance(arg, int):
                self.last[arg] = n
                if kind not in ("first", "recheck"):
                    self.needs_inputs.add(arg)

    def step(self, n: int) -> None:
        """Step n (its wall time is counted by kind in `judge.by_step` by the caller)."""
        j, specs, budget, secret = self.judge, self.specs, self.budget, self.secret
        cases, last = self.cases, self.last
        kind, arg = self.steps[n]
        if kind == "burst":
            seeds = [secret.seed() for _ in range(budget.burst_sets)]
            samples = secret.rng.sample(range(len(seeds)), min(budget.burst_samples, len(seeds)))
            self.burst_info = fu.burst(j, arg, seeds, budget.burst_reps, samples,
                                       budget.burst_bytes)
            return
        if kind == "marathon":
            lo, hi = budget.marathon_s
            j.marathon = fu.marathon(j, arg, [secret.seed() for _ in range(3)],
                                     calls=secret.tokens(max(1, budget.marathon_calls // 10),
                                                         budget.marathon_calls),
                                     time_s=secret.rng.uniform(lo, hi),
                                     max_bytes=budget.burst_bytes)
            return
        if kind == "first":
            shape, seed, edge = specs[arg]
            cases[arg] = case = j.make_case(shape, seed, edge)
            if case is not None:
                j.first_call(case)
                if arg not in self.needs_inputs and last.get(arg) != n and case.handle:
                    # Only rechecks of its output follow: its inputs (a MoE rank's are ~9 GiB)
                    # are freed now, in the worker and here; the output stays for the recheck.
                    j.drop([case.handle], [])
                    case.handle, case.args = None, ()
        else:
            case = cases.get(arg)
            if case is not None and case.first is not None:
                _FOLLOW[kind](j, case, secret)
        if last.get(arg) == n and (case := cases.get(arg)) is not None and \
                (case.handle or case.out_id):
            j.drop([case.handle] if case.handle else [], [case.out_id] if case.out_id else [])
            case.args = case.ref = ()  # free the judge's copies too
            case.near, case.first, case.alt = {}, None, None


def _each_changing(fn: Callable) -> Callable:
    def go(j: Judge, case: Case, secret: Secret) -> None:
        for i in fu.changing_inputs(j, case):
            fn(j, case, i, secret)
    return go


_FOLLOW: dict[str, Callable[[Judge, Case, Secret], None]] = {
    "repeat": lambda j, c, s: fu.repeat(j, c),
    "same_buffers": lambda j, c, s: fu.same_buffers(j, c),
    "dependence": _each_changing(lambda j, c, i, s: fu.dependence(j, c, i)),
    "one_element": _each_changing(lambda j, c, i, s: fu.one_element(j, c, i, s.rng)),
    "shuffled_random": lambda j, c, s: fu.shuffled(j, c, "random"),
    "shuffled_reverse": lambda j, c, s: fu.shuffled(j, c, "reverse"),
    "recheck": lambda j, c, s: fu.recheck(j, c),
    "state": lambda j, c, s: fu.keeps_state(j, c, s.seed()),
}
