"""`autoopt optimize --target cpu-tiny` end to end on the CPU (template agent, Triton
interpreter), interrupted while it evaluates its second op's proposal and resumed, then
replayed."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from autoopt.cli import app
from autoopt.loop_eval import HarnessEvaluator

from .agents_support import registry_files

OPS = ("swiglu", "attn_output_gate")
# Small on purpose (CI has 2 cores): 2 layers, one seed, one extra verify shape, 2 trials.
FAST = ["--target", "cpu-tiny", "--agent", "template", "--ops", ",".join(OPS),
        "--max-candidates", "2", "--trials", "2", "--layers", "2", "--verify-seeds", "1",
        "--verify-tokens", "5", "--bench-iters", "2", "--budget", "20m"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """An optimize run interrupted (Ctrl-C) while its second op's proposal is being evaluated,
    then resumed."""
    root = tmp_path_factory.mktemp("optimize")
    reg, runs = root / "registry", root / "runs"
    paths = ["--registry", str(reg), "--runs-dir", str(runs)]
    real, calls = HarnessEvaluator._run, []

    def ctrl_c_in_second_evaluation(self, job):
        if job.kind == "eval":
            calls.append(job.op)
            if len(calls) == 2:
                raise KeyboardInterrupt
        return real(self, job)

    cli = CliRunner()
    mp = pytest.MonkeyPatch()
    mp.setattr(HarnessEvaluator, "_run", ctrl_c_in_second_evaluation)
    try:
        first = cli.invoke(app, ["optimize", *FAST, *paths])
    finally:
        mp.undo()
    (run_dir,) = list(runs.iterdir())
    interrupted = json.loads((run_dir / "state.json").read_text())
    pending = sorted(p.name for p in run_dir.glob("ops/*/candidates/*.pending.json"))
    resumed = cli.invoke(app, ["optimize", "--resume", str(run_dir)])
    return {"first": first, "interrupted": interrupted, "resumed": resumed, "dir": run_dir,
            "registry": reg, "runs": runs, "calls": calls, "pending": pending}


def test_interrupt_keeps_the_finished_op_and_says_how_to_resume(run):
    st = run["interrupted"]
    assert run["first"].exit_code != 0
    assert "--resume" in run["first"].output
    assert st["phase"] == "interrupted"
    by_op = {o["op"]: o for o in st["ops"]}
    done = run["calls"][0]
    other = next(op for op in OPS if op != done)
    assert by_op[done]["status"] == "done" and by_op[done]["attempts"] == 1
    assert by_op[other]["status"] == "running" and by_op[other].get("attempts", 0) == 0
    # The proposal whose evaluation was cut waits, unjudged, beside its candidate file.
    assert run["pending"] == ["a01_tiles.pending.json"]


def test_resume_finishes_the_run_with_registry_e2e_and_report(run):
    assert run["resumed"].exit_code == 0, run["resumed"].output
    st = json.loads((run["dir"] / "state.json").read_text())
    assert st["phase"] == "done"
    assert all(o["status"] == "done" for o in st["ops"])
    # Each op attempted once in total: the resumed run did not redo the finished op, and it
    # judged the interrupted op's pending proposal instead of asking the agent again.
    lines = (run["dir"] / "attempts.jsonl").read_text().splitlines()
    assert sorted(json.loads(x)["attempt"]["op"] for x in lines) == sorted(OPS)
    other = json.loads(lines[-1])["attempt"]
    assert other["op"] == run["calls"][1] and other["candidate"] == "a01_tiles"
    log = (run["dir"] / "run.log").read_text()
    assert "evaluating the proposal an interrupted run left unjudged" in log
    assert not list(run["dir"].glob("ops/*/candidates/*.pending.json"))
    from model.registry import Registry

    reg = Registry(run["registry"])
    for op in OPS:
        assert reg.variants(op) == ["template_tiles_v1"]
        rec = reg.read_record(op, "template_tiles_v1")
        # CPU rule: registered as candidate, speed not judged, never locked.
        assert rec.status == "candidate" and rec.optimize["speed_judged"] is False
        assert rec.verdicts() == {"cpu": "pass"}
        # On the CPU nothing is timed: no benchmark rows, no tuned configs, no speedup.
        assert not rec.benchmarks and rec.optimize["speedup"] is None
        assert not rec.proposed_configs and not reg.config_path(op, "template_tiles_v1").exists()
        notes = (reg.root / op / "NOTES.md").read_text()
        assert "Hypothesis:" in notes and "Prediction:" in notes and "Result:" in notes
        assert (run["dir"] / "ops" / op / "optuna.journal").is_file()
    assert not reg.lock_path.exists()
    e2e = st["e2e"]
    assert e2e["ran"] and e2e["parity"] is True and e2e["new_set"] == "lock:e2e.lock.toml"
    assert set(e2e["sources"]) == set(OPS)
    report = (run["dir"] / "report.md").read_text()
    assert "speed was not judged" in report and "End-to-end check (bench model)" in report
    log = (run["dir"] / "run.log").read_text()  # progress without a terminal
    assert "budget 1200 s, planned:" in log and "sessions: done in" in log
    for png in ("time_per_op", "speedup_per_op", "candidate_history"):
        assert (run["dir"] / "plots" / f"{png}.png").stat().st_size > 1000
    assert (run["dir"] / "e2e" / "bench_model.png").stat().st_size > 1000
    assert (run["dir"] / "profile_before.json").is_file()


def test_replay_reproduces_the_verdicts_without_touching_the_registry(run):
    before = {p: p.read_bytes() for p in registry_files(run["registry"])}
    res = CliRunner().invoke(app, ["optimize", "--replay", str(run["dir"]),
                                   "--runs-dir", str(run["runs"])])
    assert res.exit_code == 0, res.output
    assert "all verdicts reproduced" in res.output
    (replay_dir,) = [p for p in run["runs"].iterdir() if p.name.endswith("-replay")]
    data = json.loads((replay_dir / "replay.json").read_text())
    assert data["all_reproduced"] and len(data["rows"]) == len(OPS)
    assert all(r["recorded"] == r["replayed"] == "pass" for r in data["rows"])
    assert {p: p.read_bytes() for p in registry_files(run["registry"])} == before


def _md_table(report: str, heading: str) -> dict[str, list[str]]:
    """The first markdown table under `heading`: first cell -> the other cells."""
    section = report.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("| ") and "---" not in ln][1:]
    return {cells[0]: cells[1:]
            for cells in ([c.strip() for c in ln.strip("|").split("|")] for ln in rows)}


def test_report_headline_is_the_served_step_against_its_floor(run):
    """The report opens with bench model's table: per batch size, the floor and each kernel
    set's ms per step with its multiple of the floor, the numbers of e2e/bench_model.json."""
    d = run["dir"]
    data = json.loads((d / "e2e" / "bench_model.json").read_text())
    assert data["kernels"] == ["reference", "tuned", "lock:e2e.lock.toml"]
    assert data["meaningful"] is False and data["gpu"] == "cpu"
    report = (d / "report.md").read_text()
    assert report.index("## The served step against its floor") < report.index("## Ops by")
    table = _md_table(report, "## The served step against its floor")
    assert sorted(int(b) for b in table) == sorted({r["batch"] for r in data["rows"]})
    for r in data["rows"]:
        cells = table[str(r["batch"])]
        col = 2 + data["kernels"].index(r["kernels"])
        assert cells[col] == f"{r['median_ms']:.3f} ({r['x_floor']:.1f}x)"
        assert cells[0] == str(r["context"]) and cells[1] == f"{r['floor_ms']:.3f}"
        assert r["parity"] or r["kernels"] == "reference"
        if r["kernels"] != "reference":
            assert r["parity"]["top1_agree"] and r["parity"]["finite"]
    # The floor is the step's: its routing's experts plus KV, from the recorded pass.
    for f in data["floors"].values():
        assert f["routing"] == "recorded" and f["weight_bytes"] > 0 and f["kv_bytes"] > 0
