"""The loop's rules without a GPU: budgets, the GPU win rule, checkpoints, workers, refusals."""

from __future__ import annotations

import json
import os

import pytest

from autoopt import loop
from autoopt.agents import Proposal
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


def _gpu_evaluator(tmp_path, monkeypatch, cand_us: float, base_iqr: float = 0.1,
                   floor_ok: bool = True, auto_accept: bool = True):
    """A harness on an sm_90 context whose verification passes and whose bench is scripted."""
    _, task, _, recorded = harness(tmp_path, "swiglu")
    from model.registry import Registry

    ctx = RunContext(run_dir=tmp_path / "run", registry=Registry(tmp_path / "reg"),
                     target=load_target("h200-tp8-decode"), arch="sm_90", gpu="NVIDIA H200",
                     auto_accept=auto_accept)
    ev = HarnessEvaluator(ctx, task, "cuda:0", [{"T": 1, "I": 2560}, {"T": 8, "I": 2560}],
                          lambda *a: recorded.append(a))
    monkeypatch.setattr(ev, "_verify", lambda path, p: ([], [{"verdict": "pass",
                                                            "device": "cuda:0"}]))

    def bench(path, per_bucket):
        return [{"shape": {"T": t, "I": 2560}, "median_us": cand_us, "iqr_us": base_iqr,
                 "reference_us": 10.0, "x_reference": 10.0 / cand_us, "x_compile": None,
                 "pct_of_floor": 50.0, "floor_ok": floor_ok, "meaningful": True,
                 "config": per_bucket.get(f"T={t}")} for t in (1, 8)]

    monkeypatch.setattr(ev, "_bench_variant", bench)
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


def test_gpu_win_within_noise_is_not_registered(tmp_path, monkeypatch):
    # 3% faster but with 5% IQR: inside the noise, so not a win.
    ctx, ev = _gpu_evaluator(tmp_path, monkeypatch, cand_us=10.0 / 1.03, base_iqr=0.5)
    a = ev.evaluate(_proposal()).attempt
    assert a.verdict == "pass" and "does not beat the noise threshold" in a.outcome
    assert ctx.registry.variants("swiglu") == []


def test_faster_than_the_floor_is_void(tmp_path, monkeypatch):
    ctx, ev = _gpu_evaluator(tmp_path, monkeypatch, cand_us=1.0, floor_ok=False)
    a = ev.evaluate(_proposal()).attempt
    assert "faster than the floor" in a.outcome and ctx.registry.variants("swiglu") == []


def test_harness_failure_is_recorded_not_fatal(tmp_path, monkeypatch):
    _, ev = _gpu_evaluator(tmp_path, monkeypatch, cand_us=5.0)
    monkeypatch.setattr(ev, "_verify", lambda *a: 1 / 0)
    a = ev.evaluate(_proposal()).attempt
    assert a.verdict == "error" and "ZeroDivisionError" in a.reasons[0]


def test_agent_code_is_never_timed_in_process(tmp_path):
    _, _, ev, _ = harness(tmp_path, "swiglu")
    with pytest.raises(PermissionError, match="sandbox"):
        ev.time_configs(Proposal(source="x", meta={"agent": "claude"}), [{}], {"T": 1, "I": 8})


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


def _fake_one_op(args, agent, ctx, state, op, device, deadline, console, end=None):
    state.update_op(op, status="done", device=device, pid=os.getpid(),
                    visible=os.environ.get("CUDA_VISIBLE_DEVICES"), deadline=deadline)


def test_one_worker_process_per_gpu_pinned_with_cuda_visible_devices(tmp_path, monkeypatch):
    ops = ["swiglu", "rmsnorm", "qk_norm_rope", "logit_softcap", "attn_output_gate"]
    st = RunState.create(tmp_path / "run", {"ops": []}, "cpu-tiny")
    st.set_ops([{"op": o} for o in ops])
    ctx = RunContext(run_dir=st.run_dir, registry=None, target=load_target("cpu-tiny"),
                     arch="sm_90", gpu="NVIDIA H200")
    monkeypatch.setattr(loop, "_devices", lambda ctx, device=None: ["cuda:0", "cuda:1"])
    monkeypatch.setattr(loop, "_one_op", _fake_one_op)  # inherited by the forked workers
    agent = type("Stub", (), {"name": "template"})()
    args = OptimizeArgs(target="cpu-tiny", budget_s=60)
    import time

    loop._sessions(args, agent, ctx, st, loop.Console(), time.monotonic() + 60,
                   mp_context="fork")
    done = {o["op"]: o for o in st.data["ops"]}
    assert all(done[o]["status"] == "done" for o in ops)  # every worker's writes merged
    assert {done[o]["device"] for o in ops} == {"cuda:0"}  # each sees its GPU as cuda:0
    assert {done[o]["visible"] for o in ops} <= {"0", "1"}
    assert len({done[o]["pid"] for o in ops}) <= 2 and os.getpid() not in {
        done[o]["pid"] for o in ops}
    # Rounds of two: ops 0-1 get the first half of the budget, 2-3 the second, 4 the third.
    dl = [done[o]["deadline"] for o in ops]
    assert dl[0] == dl[1] < dl[2] == dl[3] < dl[4]


def test_devices(monkeypatch):
    import torch

    ctx = RunContext(run_dir=None, registry=None, target=load_target("h200-tp8-decode"),
                     arch="sm_90", gpu="NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert loop._devices(ctx) == ["cuda:0", "cuda:1"]
    assert loop._devices(ctx, "cuda:1") == ["cuda:1"]
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


def test_resume_of_a_finished_run_only_rewrites_the_report(tmp_path, monkeypatch):
    st = RunState.create(tmp_path / "run", {**OptimizeArgs(e2e=False).__dict__,
                                            "agent": "template"}, "cpu-tiny")
    st.update(profile={"rows": [], "meaningful": False})
    st.set_ops([{"op": "swiglu", "status": "done", "time_us": 1.0}])
    called = []
    monkeypatch.setattr(loop, "_one_op", lambda *a: called.append(a))
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
    from autoopt.loop import _deadline

    # 7 ops, one worker: op k's end is start + 100 (k + 1).
    assert [_deadline(0.0, 700.0, k, 7, 1) for k in range(7)] == [100.0 * (k + 1)
                                                                  for k in range(7)]
    # Two workers: rounds of two ops share each 175 s slice.
    assert [_deadline(0.0, 700.0, k, 7, 2) for k in range(4)] == [175.0, 175.0, 350.0, 350.0]
    assert max(_deadline(0.0, 700.0, k, 7, 3) for k in range(7)) == 700.0  # never past the end
