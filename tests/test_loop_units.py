"""The loop's rules without a GPU: budgets, the GPU win rule, checkpoints, workers, refusals."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from autoopt import loop
from autoopt.agents import Proposal
from autoopt.agents.base import Attempt, OptimizationTask
from autoopt.agents.template import CATALOG
from autoopt.loop import OptimizeArgs, parse_budget
from autoopt.loop_eval import HarnessEvaluator, RunContext
from autoopt.runstate import RunState
from autoopt.targets import TargetError, load_target

from .agents_support import harness


@pytest.mark.parametrize("text,seconds", [("30m", 1800), ("90s", 90), ("1.5h", 5400),
                                          ("45", 45), (12, 12)])
def test_parse_budget(text, seconds):
    assert parse_budget(text) == seconds


def test_parse_budget_rejects_nonsense():
    with pytest.raises(ValueError, match="30m, 90s or 1h"):
        parse_budget("soon")


class ScriptedFarm:
    """A farm whose eval jobs pass verification and return scripted bench rows."""

    kind = "scripted"
    workers = ["scripted"]

    def __init__(self, cand_us: float, base_iqr: float, floor_ok: bool) -> None:
        self.cand_us, self.base_iqr, self.floor_ok = cand_us, base_iqr, floor_ok
        self.jobs: list = []
        self.fail: Exception | None = None
        self.untimed: str | None = None
        self.unjudged: str | None = None

    def submit(self, job):
        from concurrent.futures import Future

        self.jobs.append(job)
        fut = Future()
        if self.fail is not None:
            fut.set_exception(self.fail)
            return fut
        rows = [{"shape": {"T": t, "I": 2560}, "median_us": self.cand_us,
                 "iqr_us": self.base_iqr, "reference_us": 10.0,
                 "x_reference": 10.0 / self.cand_us, "x_compile": None, "pct_of_floor": 50.0,
                 "floor_ok": self.floor_ok, "meaningful": True,
                 "config": job.per_bucket.get(f"T={t}")} for t in (1, 8)]
        fut.set_result({"reasons": [], "reports": [{"verdict": "pass", "device": "cuda:0"}],
                        "rows": [] if self.untimed else rows, "baseline_rows": [],
                        "device_s": 1.5, "kind": job.kind, "worker": "host/cuda:0",
                        **({"untimed": self.untimed} if self.untimed else {}),
                        **({"unjudged": self.unjudged} if self.unjudged else {})})
        return fut


def _gpu_evaluator(tmp_path, monkeypatch, cand_us: float, base_iqr: float = 0.1,
                   floor_ok: bool = True, auto_accept: bool = True):
    """A harness on an sm_90 context whose verification passes and whose bench is scripted."""
    _, task, _, recorded = harness(tmp_path, "swiglu")
    from autoopt.budget import Ledger
    from model.registry import Registry

    ctx = RunContext(run_dir=tmp_path / "run", registry=Registry(tmp_path / "reg"),
                     target=load_target("h200-tp8-decode"), arch="sm_90", gpu="NVIDIA H200",
                     auto_accept=auto_accept)
    farm = ScriptedFarm(cand_us, base_iqr, floor_ok)
    ev = HarnessEvaluator(ctx, task, "cuda:0", [{"T": 1, "I": 2560}, {"T": 8, "I": 2560}],
                          lambda *a: recorded.append(a), farm=farm, ledger=Ledger())
    return ctx, ev


def _proposal() -> Proposal:
    return Proposal(source=CATALOG["swiglu"][0].render(), name_hint="tiles",
                    meta={"agent": "template", "template": "tiles"},
                    configs={"T=1": {"ROWS": 1}, "T=8": {"ROWS": 4}})


def test_gpu_winner_beyond_noise_is_accepted_and_locked(tmp_path, monkeypatch):
    ctx, ev = _gpu_evaluator(tmp_path, monkeypatch, cand_us=5.0)
    a = ev.evaluate(_proposal()).attempt
    assert a.verdict == "pass" and a.speedup == pytest.approx(2.0) and a.meaningful
    assert a.outcome == "registered swiglu/template_tiles_v1 as accepted and locked for sm_90"
    assert ctx.registry.read_lock().section("sm_90")["swiglu"].variant == "template_tiles_v1"
    configs = ctx.registry.read_configs("swiglu", "template_tiles_v1").to_json()
    assert list(configs) == ["NVIDIA H200"] and len(configs["NVIDIA H200"]) == 1
    assert list(configs["NVIDIA H200"].values())[0] == {"T=1": {"ROWS": 1}, "T=8": {"ROWS": 4}}


def test_every_gpu_verdict_carries_its_per_shape_timings(tmp_path, monkeypatch):
    _, ev = _gpu_evaluator(tmp_path, monkeypatch, cand_us=5.0)
    text = ev.evaluate(_proposal()).to_text()
    assert "speedup 2.000x (geometric mean over the shapes)" in text
    for t in (1, 8):
        assert (f"shape {{'T': {t}, 'I': 2560}}: 5.00 us +- 0.10 us (baseline reference "
                "10.00 us, reference 10.00 us; 2.000x over the baseline, 50% of the floor's "
                "speed)") in text


def test_gpu_win_within_noise_is_not_registered(tmp_path, monkeypatch):
    # 3% faster but with 5% IQR: inside the noise, so not a win.
    ctx, ev = _gpu_evaluator(tmp_path, monkeypatch, cand_us=10.0 / 1.03, base_iqr=0.5)
    a = ev.evaluate(_proposal()).attempt
    assert a.verdict == "pass" and "does not beat the noise threshold" in a.outcome
    assert ctx.registry.variants("swiglu") == []


def test_a_candidate_the_deadline_left_untimed_is_not_registered(tmp_path, monkeypatch):
    ctx, ev = _gpu_evaluator(tmp_path, monkeypatch, cand_us=5.0)
    ev.farm.untimed = "not timed: 3 s of the job's 40 s were left for a01_tiles's timing"
    a = ev.evaluate(_proposal()).attempt
    assert a.verdict == "pass" and a.outcome.startswith("verified, not registered: not timed")
    assert a.speedup is None and ctx.registry.variants("swiglu") == []


def test_a_candidate_whose_verification_the_deadline_cut_is_unjudged(tmp_path, monkeypatch):
    ctx, ev = _gpu_evaluator(tmp_path, monkeypatch, cand_us=5.0)
    ev.farm.unjudged = "not judged: the job's 120 s ran out during its verification"
    a = ev.evaluate(_proposal()).attempt
    assert a.verdict == "error" and a.reasons == (ev.farm.unjudged,)
    assert a.outcome == "not registered: unjudged" and a.speedup is None


def _killed_mid_evaluation(tmp_path, monkeypatch):
    """A GPU evaluator whose process was killed while it evaluated proposal #1; then a new
    evaluator (the resumed run's) on the same run directory and registry."""
    ctx, ev = _gpu_evaluator(tmp_path, monkeypatch, cand_us=5.0)
    ev.farm.fail = KeyboardInterrupt()  # what a kill or Ctrl-C leaves: nothing recorded
    with pytest.raises(KeyboardInterrupt):
        ev.evaluate(dataclasses.replace(_proposal(), trusted=True))
    recorded: list = []
    task = OptimizationTask.build("swiglu", hardware={"gpu": "test"}, shapes=ev.bench_shapes,
                                  device="cuda:0")
    again = HarnessEvaluator(ctx, task, "cuda:0", ev.bench_shapes, lambda *a: recorded.append(a),
                             farm=ScriptedFarm(5.0, 0.1, True))
    return ctx, ev, again, recorded


def test_a_proposal_killed_in_its_evaluation_is_judged_first_on_resume(tmp_path, monkeypatch):
    ctx, ev, again, recorded = _killed_mid_evaluation(tmp_path, monkeypatch)
    cands = ctx.run_dir / "ops" / "swiglu" / "candidates"
    pending = cands / "a01_tiles.pending.json"
    assert pending.is_file() and (cands / "a01_tiles.py").is_file()
    (fb,) = again.resume_pending()
    a = fb.attempt
    assert (a.index, a.candidate, a.verdict) == (1, "a01_tiles", "pass")
    assert a.outcome.startswith("registered swiglu/template_tiles_v1")
    assert not pending.exists() and [r[1] for r in recorded] == [a]
    assert again.task.attempts == [a]  # the agent's sessions see it (the template skips it)
    (job,) = again.farm.jobs  # evaluated with the configs it was proposed with
    assert job.source == _proposal().source and job.per_bucket == _proposal().configs
    assert recorded[0][2]["trusted"] is False  # trust is never read back from a file
    # The next proposal gets the next number; nothing is pending any more.
    assert again.evaluate(_proposal()).attempt.index == 2 and again.resume_pending() == []


def test_a_proposal_interrupted_twice_is_recorded_as_an_error_not_run_again(tmp_path,
                                                                               monkeypatch):
    ctx, ev, again, recorded = _killed_mid_evaluation(tmp_path, monkeypatch)
    again.farm.fail = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):  # killed again in the resumed evaluation
        again.resume_pending()
    third = HarnessEvaluator(ctx, again.task, "cuda:0", ev.bench_shapes,
                             lambda *a: recorded.append(a), farm=ScriptedFarm(5.0, 0.1, True))
    (fb,) = third.resume_pending()
    assert fb.attempt.verdict == "error" and "interrupted 2 times" in fb.attempt.reasons[0]
    assert third.farm.jobs == [] and ctx.registry.variants("swiglu") == []
    assert not list((ctx.run_dir / "ops" / "swiglu" / "candidates").glob("*.pending.json"))


def test_pending_proposals_are_judged_in_the_order_they_were_numbered(tmp_path, monkeypatch):
    # Two left pending (ops on two threads can leave several): #99 before #100, although
    # "a100_..." sorts before "a99_..." by name; the numbers are the files' own.
    ctx, ev, again, recorded = _killed_mid_evaluation(tmp_path, monkeypatch)
    cands = ctx.run_dir / "ops" / "swiglu" / "candidates"
    entry = json.loads((cands / "a01_tiles.pending.json").read_text())
    (cands / "a01_tiles.pending.json").unlink()
    for index in (100, 99):
        (cands / f"a{index}_tiles.py").write_text(_proposal().source)
        (cands / f"a{index}_tiles.pending.json").write_text(
            json.dumps({**entry, "index": index, "candidate": f"a{index}_tiles"}))
    got = [(fb.attempt.index, fb.attempt.candidate) for fb in again.resume_pending()]
    assert got == [(99, "a99_tiles"), (100, "a100_tiles")]
    assert not list(cands.glob("*.pending.json"))
    assert again.evaluate(_proposal()).attempt.index == 101


def test_pending_proposals_already_recorded_or_unreadable_are_dropped(tmp_path, monkeypatch):
    ctx, ev, again, recorded = _killed_mid_evaluation(tmp_path, monkeypatch)
    cands = ctx.run_dir / "ops" / "swiglu" / "candidates"
    # Recorded just before the kill: the attempt is there, its pending file was not yet removed.
    again.task.attempts.append(Attempt(index=1, op="swiglu", candidate="a01_tiles", sha256="",
                                       verdict="pass"))
    (cands / "a07_x.pending.json").write_text("{not json")
    assert again.resume_pending() == [] and again.farm.jobs == [] and recorded == []
    assert not list(cands.glob("*.pending.json"))


def test_an_evaluation_that_ends_leaves_nothing_pending(tmp_path, monkeypatch):
    ctx, ev = _gpu_evaluator(tmp_path, monkeypatch, cand_us=5.0)
    ev.farm.fail = RuntimeError("worker lost")  # a harness error is a recorded verdict
    assert ev.evaluate(_proposal()).attempt.verdict == "error"
    assert ev.evaluate(_proposal()).attempt.index == 2
    assert not list((ctx.run_dir / "ops" / "swiglu" / "candidates").glob("*.pending.json"))
    assert ctx.registry.variants("swiglu") == []


def test_faster_than_the_floor_is_void(tmp_path, monkeypatch):
    ctx, ev = _gpu_evaluator(tmp_path, monkeypatch, cand_us=1.0, floor_ok=False)
    a = ev.evaluate(_proposal()).attempt
    assert "faster than the floor" in a.outcome and ctx.registry.variants("swiglu") == []


def test_harness_failure_is_recorded_not_fatal(tmp_path, monkeypatch):
    _, ev = _gpu_evaluator(tmp_path, monkeypatch, cand_us=5.0)
    ev.farm.fail = ZeroDivisionError("division by zero")
    a = ev.evaluate(_proposal()).attempt
    assert a.verdict == "error" and "ZeroDivisionError" in a.reasons[0]


def test_each_job_carries_what_it_needs_and_its_device_time_is_counted(tmp_path, monkeypatch):
    _, ev = _gpu_evaluator(tmp_path, monkeypatch, cand_us=5.0)
    ev.evaluate(_proposal())
    (job,) = ev.farm.jobs
    assert job.kind == "eval" and job.timed and job.source == _proposal().source
    assert job.per_bucket == {"T=1": {"ROWS": 1}, "T=8": {"ROWS": 4}}
    assert job.configs == ({"ROWS": 1}, {"ROWS": 4}) and job.baseline_source is None
    assert ev.ledger.totals()["device_s"] == 1.5 and "host/cuda:0" in ev.ledger.device


def test_agent_code_is_never_timed_in_process(tmp_path):
    _, _, ev, _ = harness(tmp_path, "swiglu")
    with pytest.raises(PermissionError, match="sandbox"):
        ev.time_configs(Proposal(source="x", meta={"agent": "template"}), [{}],
                        {"T": 1, "I": 8})
    # Trusted (a built-in template): on the CPU nothing is timed, so every trial fails.
    assert ev.time_configs(Proposal(source="x", trusted=True), [{}, {}], {"T": 1}) == [None] * 2


def test_state_survives_a_line_cut_by_a_crash(tmp_path):
    from autoopt.agents import Attempt

    st = RunState.create(tmp_path / "run", {"ops": []}, "cpu-tiny")
    st.set_ops([{"op": "swiglu"}, {"op": "rmsnorm"}])
    a = Attempt(index=1, op="swiglu", candidate="a01_tiles", sha256="s", verdict="pass",
                speedup=1.5, outcome="registered swiglu/template_tiles_v1 as candidate")
    st.record_attempt("swiglu", a, {"name_hint": "tiles"})
    with (st.run_dir / "attempts.jsonl").open("a") as f:
        f.write('{"attempt": {"index": 2, "op": "swi')  # killed mid-write
    again = RunState.load(st.run_dir)
    assert [x.candidate for x, _ in again.attempts()] == ["a01_tiles"]
    assert again.winners() == {"swiglu": {"variant": "template_tiles_v1", "speedup": 1.5,
                                          "candidate": "a01_tiles"}}
    assert again.pending_ops() == ["swiglu", "rmsnorm"]
    with pytest.raises(FileNotFoundError, match="not an optimize run directory"):
        RunState.load(tmp_path)


def _fake_one_op(args, agent, ctx, state, op, deadline, console, end=None, farm=None,
                 ledger=None, eval_s=0.0):
    import threading

    state.update_op(op, status="done", thread=threading.current_thread().name,
                    workers=list(farm.workers), deadline=deadline)


def test_ops_run_as_many_at_a_time_as_there_are_workers(tmp_path, monkeypatch):
    ops = ["swiglu", "rmsnorm", "qk_norm_rope", "logit_softcap", "attn_output_gate"]
    st = RunState.create(tmp_path / "run", {"ops": []}, "cpu-tiny")
    st.set_ops([{"op": o} for o in ops])
    ctx = RunContext(run_dir=st.run_dir, registry=None, target=load_target("cpu-tiny"),
                     arch="cpu", gpu="cpu")
    monkeypatch.setattr(loop, "_one_op", _fake_one_op)
    agent = type("Stub", (), {"name": "template"})()
    args = OptimizeArgs(target="cpu-tiny", budget_s=60, workers=2)
    import time

    start = time.monotonic()
    loop._sessions(args, agent, ctx, st, loop.Console(), start + 60)
    st.reload()
    done = {o["op"]: o for o in st.data["ops"]}
    assert all(done[o]["status"] == "done" for o in ops)
    assert {tuple(done[o]["workers"]) for o in ops} == {("cpu", "cpu")}
    assert {done[o]["thread"] for o in ops} <= {"autoopt-op-0", "autoopt-op-1"}
    # Rounds of two: each op, when it starts, gets an equal share per round of what is left.
    assert all(done[o]["deadline"] <= start + 60 for o in ops)
    assert st.data["costs"] == {"api": {}, "device": {}, "lost": []}


def test_devices(monkeypatch):
    import torch

    ctx = RunContext(run_dir=None, registry=None, target=load_target("h200-tp8-decode"),
                     arch="sm_90", gpu="NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert loop._devices(ctx) == ["cuda:0", "cuda:1"]
    assert loop._devices(ctx, "cuda:1") == ["cuda:1"]
    assert loop._devices(ctx, gpus=(1,)) == ["cuda:1"]
    with pytest.raises(ValueError, match="GPUs 0..1"):
        loop._devices(ctx, gpus=(2,))
    cpu = RunContext(run_dir=None, registry=None, target=load_target("cpu-tiny"), arch="cpu",
                     gpu="cpu")
    assert loop._devices(cpu) == ["cpu"]
    with pytest.raises(ValueError, match="runs on the cpu"):
        loop._devices(cpu, "cuda:0")


def test_gpu_target_without_gpu_is_refused_before_any_work(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(TargetError, match="cpu-tiny"):
        loop.optimize(OptimizeArgs(target="h200-tp8-decode", agent="template",
                                   runs_dir=str(tmp_path / "runs")))
    assert not (tmp_path / "runs").exists()
    assert loop.default_target() == "cpu-tiny"


def test_sigterm_stops_the_run_as_ctrl_c_does(tmp_path, monkeypatch):
    import os
    import signal
    import time

    st = RunState.create(tmp_path / "run", {**OptimizeArgs(e2e=False).__dict__,
                                            "agent": "template"}, "cpu-tiny")
    st.update(profile={"rows": [], "meaningful": False})
    st.set_ops([{"op": "swiglu", "status": "pending", "time_us": 1.0}])
    before = signal.getsignal(signal.SIGTERM)

    def killed(*a, **kw):  # a batch scheduler's stop while an op's session runs
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the handler interrupts this
        raise AssertionError("SIGTERM did not stop the run")

    monkeypatch.setattr(loop, "_one_op", killed)
    with pytest.raises(KeyboardInterrupt, match="stopped by signal"):
        loop.optimize(OptimizeArgs(), resume=st.run_dir)
    data = json.loads((st.run_dir / "state.json").read_text())
    assert data["phase"] == "interrupted"
    log = (st.run_dir / "run.log").read_text()
    assert f"resume with autoopt optimize --resume {st.run_dir}" in log
    assert signal.getsignal(signal.SIGTERM) == before  # restored after the run


def test_an_evaluation_failing_while_the_run_stops_stays_pending(tmp_path, monkeypatch):
    ctx, ev = _gpu_evaluator(tmp_path, monkeypatch, cand_us=5.0)
    recorded = []
    ev.record = lambda *a: recorded.append(a)
    ctx.stopping.set()  # Ctrl-C or SIGTERM: the farm is closing under the evaluation
    ev.farm.fail = RuntimeError("farm closed")
    with pytest.raises(RuntimeError, match="farm closed"):
        ev.evaluate(_proposal())
    assert recorded == []  # not the candidate's error: nothing judged it
    assert [p.name for p in (ctx.run_dir / "ops" / "swiglu" / "candidates").glob(
        "*.pending.json")] == ["a01_tiles.pending.json"]


class _TwoWorkers:
    kind, workers, lost = "fake", ["w0", "w1"], []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_run_stopped_with_ops_on_two_workers_leaves_them_to_resume(tmp_path, monkeypatch):
    import os
    import signal
    import threading
    import time

    import autoopt.farm

    ctx, _, _, _ = harness(tmp_path, "swiglu")
    ops = ["swiglu", "rmsnorm", "logit_softcap", "attn_output_gate"]
    st = RunState.create(tmp_path / "run", {**OptimizeArgs().__dict__, "agent": "template"},
                         "cpu-tiny")
    st.set_ops([{"op": op, "status": "pending"} for op in ops])
    monkeypatch.setattr(loop, "farm_spec", lambda args, ctx: _TwoWorkers())
    monkeypatch.setattr(autoopt.farm, "open_farm", lambda spec: spec)
    started, both = [], threading.Barrier(2)

    def one_op(args, agent, ctx, state, op, *rest, **kw):  # its evaluation, on a worker
        state.update_op(op, status="running")
        started.append(op)
        if both.wait(timeout=10) == 0:
            os.kill(os.getpid(), signal.SIGTERM)  # the run is stopped while both evaluate
        for _ in range(1000):
            if ctx.stopping.is_set():
                break
            time.sleep(0.01)
        raise RuntimeError("farm closed")  # what their evaluations then meet

    monkeypatch.setattr(loop, "_one_op", one_op)
    with loop.sigterm_interrupts(), pytest.raises(KeyboardInterrupt):
        loop._sessions(OptimizeArgs(), None, ctx, st, None, time.monotonic() + 1000)
        time.sleep(30)  # not reached: the signal interrupts the join
    for t in threading.enumerate():  # the op threads end on their own
        if t.name.startswith("autoopt-op-"):
            t.join(timeout=20)
    st.reload()
    status = {o["op"]: o["status"] for o in st.data["ops"]}
    # The two evaluating ops stay running (not failed), the others were never started.
    assert sorted(started) == sorted(ops[:2]) and ctx.stopping.is_set()
    assert status == {**dict.fromkeys(ops[:2], "running"), **dict.fromkeys(ops[2:], "pending")}
    assert st.pending_ops() == ops


def test_resume_of_a_finished_run_only_rewrites_the_report(tmp_path, monkeypatch):
    st = RunState.create(tmp_path / "run", {**OptimizeArgs(e2e=False).__dict__,
                                            "agent": "template"}, "cpu-tiny")
    st.update(profile={"rows": [], "meaningful": False})
    st.set_ops([{"op": "swiglu", "status": "done", "time_us": 1.0}])
    called = []
    monkeypatch.setattr(loop, "_one_op", lambda *a, **kw: called.append(a))
    out = loop.optimize(OptimizeArgs(), resume=st.run_dir)
    assert out == st.run_dir and called == []
    assert json.loads((st.run_dir / "state.json").read_text())["phase"] == "done"
    assert (st.run_dir / "report.md").is_file()


def test_unknown_ops_fail_before_any_work(tmp_path):
    with pytest.raises(ValueError, match="unknown op"):
        loop.optimize(OptimizeArgs(target="cpu-tiny", agent="template", ops=("softmax",),
                                   runs_dir=str(tmp_path / "runs")))
    assert not (tmp_path / "runs").exists()


def test_deadlines_share_the_sessions_time_in_rounds():
    from autoopt.loop import op_deadline

    # 7 ops, one worker: the first gets a seventh of the time, at least its minimum.
    assert op_deadline(0.0, 700.0, 7, 0.0) == 100.0
    assert op_deadline(0.0, 700.0, 7, 150.0) == 150.0
    # Two workers: 7 ops are 4 rounds, each op a quarter of what is left.
    assert op_deadline(0.0, 700.0, 7, 0.0, slots=2) == 175.0
    assert op_deadline(600.0, 700.0, 1, 0.0, slots=3) == 700.0  # never past the end
    assert op_deadline(690.0, 700.0, 3, 0.0, min_start_s=20.0) is None


def test_agents_declare_their_options_and_the_loop_passes_them_through():
    from autoopt.agents import describe_options, parse_options

    assert parse_options("template", {"trials": "16", "seed": 3}) == {"trials": 16, "seed": 3}
    assert parse_options("claude", {"budget_usd": "2.5", "model": "claude-opus-5"}) == {
        "budget_usd": 2.5, "model": "claude-opus-5"}
    with pytest.raises(ValueError, match="has no option 'model'.*trials=8"):
        parse_options("template", {"model": "x"})
    with pytest.raises(ValueError, match="trials must be >= 0"):
        parse_options("template", {"trials": "-1"})
    assert "max_turns=40" in describe_options("claude")
    args = OptimizeArgs(agent_options={"trials": 2})
    assert loop.agent_options(args, "template") == {"trials": 2}
    # Nothing in the loop names an agent.
    import inspect

    for mod in (loop, __import__("autoopt.loop_eval", fromlist=["x"])):
        assert '"template"' not in inspect.getsource(mod)


def test_cli_agent_options_are_listed_and_checked_before_any_work(tmp_path):
    from typer.testing import CliRunner

    from autoopt.cli import app

    res = CliRunner().invoke(app, ["optimize", "--agent-option", "help"])
    assert res.exit_code == 0 and "trials=8" in res.output and "max_turns=40" in res.output
    runs = tmp_path / "runs"
    res = CliRunner().invoke(app, ["optimize", "--target", "cpu-tiny", "--agent", "template",
                                   "--model", "claude-opus-5", "--runs-dir", str(runs)])
    assert res.exit_code == 2 and "has no option 'model'" in res.output
    res = CliRunner().invoke(app, ["optimize", "--target", "cpu-tiny", "--agent", "template",
                                   "-O", "trials", "--runs-dir", str(runs)])
    assert res.exit_code == 2 and "KEY=VALUE" in res.output
    assert not runs.exists()


def test_an_evaluation_is_bounded_by_the_ops_deadline_as_a_whole(tmp_path, monkeypatch):
    import time

    from autoopt.loop_eval import DEADLINE_GRACE_S

    _, ev = _gpu_evaluator(tmp_path, monkeypatch, cand_us=5.0)
    assert ev.budget_s() is None and ev.timeout_s() == ev.ctx.verify_timeout_s
    ev.deadline = time.monotonic() + 1000.0  # far: a verification keeps its own limit
    assert 1000 < ev.budget_s() <= 1000 + DEADLINE_GRACE_S
    assert ev.timeout_s() == ev.ctx.verify_timeout_s
    ev.deadline = time.monotonic() + 40.0
    assert ev.timeout_s() == pytest.approx(ev.budget_s(), abs=0.5) and ev.budget_s() < 56
    ev.hard_deadline = time.monotonic() + 10.0  # the sessions' end comes first
    assert ev.budget_s() <= 10.0
    ev.evaluate(_proposal())
    job = ev.farm.jobs[-1]
    assert job.budget_s <= 10.0 and job.timeout_s <= 10.0


def test_an_op_whose_evaluation_cannot_fit_is_not_started_and_one_that_can_gets_its_time():
    # On an H200 a MoE template's verification (~150-230 s there) was cut off by its op's 116 s
    # and recorded as a hang. The loop now estimates one evaluation from the op's recorded
    # verifications on this arch and starts the op only where that fits.
    from autoopt.loop import fit_deadline, judge_seconds
    from model.registry import Registry

    assert fit_deadline(None, 0.0, 120.0, 300.0) == (120.0, "")  # nothing recorded: as before
    assert fit_deadline(100.0, 0.0, 120.0, 300.0) == (120.0, "")  # it fits its share
    assert fit_deadline(200.0, 0.0, 120.0, 300.0) == (200.0, "")  # taken from the rest
    deadline, why = fit_deadline(250.0, 100.0, 220.0, 300.0)  # 200 s left: not started
    assert deadline is None and "needs ~250 s" in why and "200 s were left" in why
    reg = Registry(Path(__file__).resolve().parents[1] / "kernels")
    moe = judge_seconds(reg, "moe_experts", "sm_90")
    assert moe is not None and moe > 120  # the shipped records' H200 verifications
    assert judge_seconds(reg, "moe_experts", "sm_100") is None
    assert judge_seconds(reg, "moe_experts", None) is None
    # The longest recorded verification, not a typical one: on an H100 (sm_90, like the H200
    # whose records gave a 217 s estimate) a MoE template's took ~184 s, and its timing was
    # cut off with 33 s left of the job.
    from types import SimpleNamespace

    def rec(*secs):
        return SimpleNamespace(verification={"sm_90": [SimpleNamespace(report={"elapsed_s": t})
                                                       for t in secs]})
    fake = SimpleNamespace(variants=lambda op: ["a", "b", "c"],
                           read_record=lambda op, n: {"a": rec(74.0, 90.0), "b": rec(228.0),
                                                      "c": None}[n])
    assert judge_seconds(fake, "moe_experts", "sm_90") == 228.0
    # Timing is the candidate's and the baseline's, per token bucket: eight buckets of decode
    # attention at a 100k-token context took more than 30 s for the baseline alone on an H200.
    assert loop.timing_seconds(8) >= 60 and loop.timing_seconds(8) == 8 * loop.timing_seconds(1)
    # ... and an op slow to verify is slow to time: on an H100 a MoE candidate's timing and its
    # baseline's (eight buckets) took more than 100 s. Fast ops keep the per-bucket floor.
    assert loop.timing_seconds(8, 228.0) > 100 + 16
    assert loop.timing_seconds(8, 20.0) == loop.timing_seconds(8)
    assert loop.timing_seconds(8, 228.0) > loop.timing_seconds(8, 114.0)


def _gpu_state(tmp_path: Path, e2e_rows: list[dict] | None = None):
    """A finished GPU run's state as the report reads it (profile by batch, e2e bench JSON)."""
    from types import SimpleNamespace

    from autoopt.profiler.attribution import GRAPH_IDLE, OUTSIDE

    def rows(kernel_us: float, idle_us: float, outside_us: float) -> list[dict]:
        return [{"op": "moe_experts", "time_us": 0.75 * kernel_us},
                {"op": "attention", "time_us": 0.25 * kernel_us},
                {"op": GRAPH_IDLE, "time_us": idle_us}, {"op": OUTSIDE, "time_us": outside_us}]

    by_batch = {"1": {"rows": rows(4000, 300, 1500), "step_us": 5800, "floor_us": 1400,
                      "context": 100000},
                "32": {"rows": rows(29000, 400, 46000), "step_us": 75400, "floor_us": 19000}}
    data = {"profile": {"by_batch": by_batch, "meaningful": True}}
    if e2e_rows is not None:
        path = tmp_path / "bench_model.json"
        path.write_text(json.dumps({"kernels": ["reference-graphs", "tuned"], "gpu": "H200",
                                    "layers": 52, "rows": e2e_rows}))
        data["e2e"] = {"ran": True, "json": str(path)}
    return SimpleNamespace(data=data)


def test_report_splits_each_step_into_kernels_graph_idle_and_host(tmp_path):
    from autoopt.report import time_split_lines

    lines = time_split_lines(_gpu_state(tmp_path))
    assert lines[0].startswith("## Where the served step's time goes")
    assert "| 1 | 100000 | 5.800 | 4.000 | 0.300 | 1.500 (26%) |" in lines
    # An older run's state has no context per batch: a dash, not a guess.
    assert "| 32 | - | 75.400 | 29.000 | 0.400 | 46.000 (61%) |" in lines
    assert any(s.startswith("idle: the gaps between the graph's kernels") for s in lines)
    assert time_split_lines(type("S", (), {"data": {}})()) == []
    # An eager step (the CPU's): its idle line is the gaps between ops, and nothing is outside.
    from autoopt.profiler.attribution import IDLE

    eager = _gpu_state(tmp_path)
    eager.data["profile"]["by_batch"] = {"3": {"rows": [
        {"op": "moe_experts", "time_us": 13000.0}, {"op": IDLE, "time_us": 9200.0}],
        "step_us": 22200.0, "floor_us": 45.8, "context": 40}}
    assert "| 3 | 40 | 22.200 | 13.000 | 9.200 | - |" in time_split_lines(eager)


def test_report_headline_marks_a_step_that_was_not_replayed_from_a_graph(tmp_path):
    from autoopt.report import headline_lines

    def row(kset: str, ms: float, bucket: int | None) -> dict:
        return {"batch": 32, "context": 100000, "kernels": kset, "ran": True, "median_ms": ms,
                "x_floor": ms / 19.0, "floor_ms": 19.0, "graph_bucket": bucket}

    out = headline_lines(_gpu_state(tmp_path, [row("reference-graphs", 213.6, None),
                                               row("tuned", 67.3, 32)]))
    line = next(s for s in out if s.startswith("| 32 |"))
    assert "213.600 (11.2x), eager" in line and "67.300 (3.5x) |" in line
    assert any(s.startswith("eager: that step was not replayed") for s in out)
    out = headline_lines(_gpu_state(tmp_path, [row("reference-graphs", 80.0, 32),
                                               row("tuned", 67.3, 32)]))
    assert not any("eager" in s for s in out)
