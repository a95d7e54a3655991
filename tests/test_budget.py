"""`--budget` bounds the whole optimize command: the plan, and the loop keeping it (fake clock)."""

from __future__ import annotations

import json

import pytest

from autoopt import loop, report
from autoopt.budget import COSTS, Costs, plan_run
from autoopt.loop import OptimizeArgs, op_deadline

COSTS_T = Costs(profile_fixed=10, profile_per_batch=5, e2e_fixed=10, e2e_per_set=2,
                e2e_per_row=4, report=5, min_sessions=60, min_op=30, min_start=10)


def test_a_roomy_budget_profiles_and_checks_every_batch():
    p = plan_run(600, "cpu", (3, 1, 17), costs=COSTS_T)
    assert p.profile_batches == (3, 1, 17) and p.e2e_batches == (3, 1, 17)
    assert [s.name for s in p.stages] == ["profile", "sessions", "e2e", "report"]
    assert p.seconds("profile") == 10 + 3 * 5
    assert p.seconds("e2e") == 10 + 3 * (2 + 3 * 4)
    assert sum(s.seconds for s in p.stages) == pytest.approx(600)  # sessions get the rest
    assert any("at least 30 s per op" in s.what for s in p.stages)


@pytest.mark.parametrize("budget,profiled,checked", [
    (600, (3, 1, 17), (3, 1, 17)),
    (140, (3,), (3, 1, 17)),  # 15 + 52 + 5 leaves 68 s for the sessions
    (110, (3,), (3,)),  # 15 + 28 + 5 leaves 62 s
    (80, (3,), ()),  # no room for the check: 15 + 5 leaves 60 s
    (30, (3,), ()),  # too small for anything but one profile: the sessions get what is left
])
def test_a_small_budget_drops_the_check_and_batches_before_the_sessions(budget, profiled,
                                                                         checked):
    p = plan_run(budget, "cpu", (3, 1, 17), costs=COSTS_T)
    assert (p.profile_batches, p.e2e_batches) == (profiled, checked)
    assert p.seconds("sessions") == max(0, budget - p.seconds("profile") - p.seconds("e2e") - 5)
    assert ("e2e" in [s.name for s in p.stages]) == bool(checked)


def test_with_compile_the_check_plans_for_torch_compiles_set_too():
    p = plan_run(600, "gpu", (3, 1, 17), costs=COSTS_T, compile=True)
    assert p.seconds("e2e") == 10 + 5 * (2 + 3 * 4)  # three sets and Inductor's, at two
    assert any("vs torch.compile" in s.what for s in p.stages)
    assert not any("torch.compile" in s.what for s in plan_run(600, "gpu", (3,), costs=COSTS_T)
                   .stages)


def test_the_check_compares_with_the_capturable_reference_and_compile_on_a_gpu(monkeypatch,
                                                                               tmp_path):
    # What end_to_end asks bench model for, by machine and flag (bench model itself faked).
    from types import SimpleNamespace

    import autoopt.bench_model as bm
    import autoopt.bench_model_report as bmr

    seen = []

    def fake_run(args, say):
        seen.append(args)
        return SimpleNamespace(kernels=list(args.kernels), rows=[], meaningful=True)

    monkeypatch.setattr(bm, "run_bench", fake_run)
    monkeypatch.setattr(bmr, "write_outputs", lambda res, out: {k: out / k for k in
                                                                 ("json", "md", "png")})
    monkeypatch.setattr(bmr, "headline", lambda res: [])
    state = SimpleNamespace(winners=lambda: {})
    target = SimpleNamespace(source=None, name="h200-tp8-decode", contexts=(100000, 8192))
    for meaningful, compile_, want in [(True, True, ("reference-graphs", "tuned", "compile")),
                                       (True, False, ("reference-graphs", "tuned")),
                                       (False, True, ("reference", "tuned"))]:
        ctx = SimpleNamespace(meaningful=meaningful, compile=compile_, target=target,
                              registry=SimpleNamespace(root=tmp_path), proxy_note="",
                              run_dir=tmp_path)
        out = report.end_to_end(ctx, state, (1, 64), None, 1e9, lambda: 0.0)
        assert seen[-1].kernels == want and out["new_set"] is None
        assert seen[-1].contexts == (100000, 8192) and seen[-1].first_fit


def test_deadlines_count_from_the_start_and_the_end():
    p = plan_run(600, "cpu", (3, 1, 17), costs=COSTS_T)
    d = p.deadlines(1000.0)
    assert d["profile"] == 1000 + p.seconds("profile")
    assert d["report"] == 1600 and d["e2e"] == 1595
    assert d["sessions"] == 1595 - p.seconds("e2e")  # profile's unused time goes to the sessions
    assert all(line for line in p.describe())


def test_an_op_starts_only_with_its_minimum_left():
    assert op_deadline(0, 300, 3, 60, 20) == 100  # an equal share
    assert op_deadline(0, 300, 10, 60, 20) == 60  # at least the minimum, fewer ops finish
    assert op_deadline(250, 300, 2, 60, 20) == 300  # 50 s left: what is left
    assert op_deadline(285, 300, 2, 60, 20) is None  # 15 s left: not started
    assert op_deadline(200, 300, 1, 60, 20) == 300  # never past the sessions' end


def test_shipped_costs_cover_both_kinds():
    assert set(COSTS) == {"cpu", "gpu"}
    with pytest.raises(ValueError, match="positive"):
        plan_run(0, "cpu", (1,))


def test_readme_command_one_on_an_h200_profiles_and_checks_every_batch_size():
    """`autoopt optimize --budget 5m` on an H200 (h200-tp8-decode serves batch 1, 8, 32, 64):
    with the measured stage costs the served step is profiled and checked end to end at every
    batch size, and the sessions keep their minimum."""
    from autoopt.targets import load_target

    batches = tuple(load_target("h200-tp8-decode").batch_sizes)
    p = plan_run(300, "gpu", batches)
    assert p.profile_batches == batches and p.e2e_batches == batches
    assert p.seconds("sessions") >= COSTS["gpu"].min_sessions
    assert sum(s.seconds for s in p.stages) == pytest.approx(300)


class FakeClock:
    def __init__(self) -> None:
        self.now = 10_000.0

    def __call__(self) -> float:
        return self.now


def test_the_loop_keeps_its_budget_with_stubbed_stages(tmp_path, monkeypatch):
    clock = FakeClock()
    costs = COSTS["cpu"]
    calls: dict[str, list] = {"profile": [], "ops": [], "e2e": []}
    ends_box = [plan_run(300, "cpu", (3, 1, 17)).deadlines(clock.now)["sessions"]]

    def profile(args, target, state, batches, deadline):
        calls["profile"].append((batches, deadline))
        clock.now += 20  # over its estimate: the sessions absorb it
        rows = [{"op": op, "time_us": 100.0 - i, "floor_us": 1.0, "gap_us": 99.0 - i}
                for i, op in enumerate(("norm_residual_norm", "swiglu", "rmsnorm",
                                        "logit_softcap", "attn_output_gate"))]
        state.update(profile={"kernels": "tuned", "rows": rows, "meaningful": False,
                              "by_batch": {"3": {"rows": rows, "step_us": 10.0,
                                                 "floor_us": 1.0}}})

    def one_op(args, agent, ctx, state, op, deadline, console, end=None, *farm_ledger, **kw):
        assert end == ends_box[0]
        calls["ops"].append((op, clock.now, deadline))
        clock.now = deadline  # every session uses all of its time
        state.update_op(op, status="done")

    def e2e(ctx, state, batches, layers, deadline, clk):
        calls["e2e"].append((batches, deadline))
        clock.now = deadline - 1
        return {"ran": False, "why": "stubbed"}

    monkeypatch.setattr(loop, "_profile", profile)
    monkeypatch.setattr(loop, "_one_op", one_op)
    monkeypatch.setattr(report, "end_to_end", e2e)
    args = OptimizeArgs(target="cpu-tiny", agent="template", budget_s=300,
                        registry=str(tmp_path / "reg"), runs_dir=str(tmp_path / "runs"))
    start = clock.now
    run_dir = loop.optimize(args, clock=clock)
    plan = plan_run(300, "cpu", (3, 1, 17))
    ends = plan.deadlines(start)
    assert calls["profile"] == [(plan.profile_batches, ends["profile"])]
    # Each op started with at least its start minimum left, ran at least its minimum where
    # there was time, and ended by the sessions' deadline.
    assert calls["ops"] and all(
        end <= ends["sessions"] and end - now >= min(costs.min_op, ends["sessions"] - now) - 1e-9
        and end - now >= costs.min_start for _, now, end in calls["ops"])
    assert calls["e2e"] == [(plan.e2e_batches, ends["e2e"])]
    assert clock.now <= start + 300
    state = json.loads((run_dir / "state.json").read_text())
    started = {op for op, _, _ in calls["ops"]}
    waiting = [o for o in state["ops"] if o["status"] == "not started"]
    assert waiting and not started & {o["op"] for o in waiting}
    assert state["plan"]["budget_s"] == 300 and state["phase"] == "done"
    log = (run_dir / "run.log").read_text()
    assert "budget 300 s, planned:" in log and "not started" in log and "report:" in log
    assert "## The served step against its floor" in (run_dir / "report.md").read_text()


def test_a_verification_child_never_outlives_the_sessions(tmp_path):
    import time

    from .agents_support import harness

    _, _, ev, _ = harness(tmp_path, "swiglu")  # verify_timeout_s = 120
    now = time.monotonic()
    assert ev.timeout_s() == 120  # no deadline: the run's limit
    ev.deadline, ev.hard_deadline = now + 30, now + 1000
    assert 44 < ev.timeout_s() <= 45  # the op's deadline plus the grace
    ev.hard_deadline = now + 35
    assert 34 < ev.timeout_s() <= 35  # the sessions' end comes first
    ev.deadline = ev.hard_deadline = now - 50
    assert ev.timeout_s() == 5.0  # past both: the shortest try, not a negative limit


def test_bench_rows_start_only_when_one_like_them_would_end_in_time():
    from autoopt.bench_model import Clock

    clock = Clock(100.0, say=lambda line: None)
    clock.row_s[(40, 17)] = 150.0
    assert not clock.over() and clock.over(clock.row_s[(40, 17)])
    assert not Clock(None, say=print).over(1e9)  # no budget, never over
