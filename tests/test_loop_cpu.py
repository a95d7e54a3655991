"""`autoopt optimize --target cpu-tiny` end to end on the CPU (template agent, Triton
interpreter), interrupted after its first op and resumed, then replayed."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from autoopt import loop
from autoopt.cli import app

from .agents_support import registry_files

OPS = ("swiglu", "attn_output_gate")
# Small on purpose (CI has 2 cores): 2 layers, one seed, one extra verify shape, 2 trials.
FAST = ["--target", "cpu-tiny", "--agent", "template", "--ops", ",".join(OPS),
        "--max-candidates", "2", "--trials", "2", "--layers", "2", "--verify-seeds", "1",
        "--verify-tokens", "5", "--bench-iters", "2", "--budget", "20m"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """An optimize run interrupted (Ctrl-C) when its second op starts, then resumed."""
    root = tmp_path_factory.mktemp("optimize")
    reg, runs = root / "registry", root / "runs"
    paths = ["--registry", str(reg), "--runs-dir", str(runs)]
    real, calls = loop.run_session, []

    def ctrl_c_on_second_op(agent, task, *a, **kw):
        calls.append(task.op)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(agent, task, *a, **kw)

    cli = CliRunner()
    mp = pytest.MonkeyPatch()
    mp.setattr(loop, "run_session", ctrl_c_on_second_op)
    try:
        first = cli.invoke(app, ["optimize", *FAST, *paths])
    finally:
        mp.undo()
    (run_dir,) = list(runs.iterdir())
    interrupted = json.loads((run_dir / "state.json").read_text())
    resumed = cli.invoke(app, ["optimize", "--resume", str(run_dir)])
    return {"first": first, "interrupted": interrupted, "resumed": resumed, "dir": run_dir,
            "registry": reg, "runs": runs, "calls": calls}


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


def test_resume_finishes_the_run_with_registry_e2e_and_report(run):
    assert run["resumed"].exit_code == 0, run["resumed"].output
    st = json.loads((run["dir"] / "state.json").read_text())
    assert st["phase"] == "done"
    assert all(o["status"] == "done" for o in st["ops"])
    # Each op attempted once in total: the resumed run did not redo the finished op.
    lines = (run["dir"] / "attempts.jsonl").read_text().splitlines()
    assert sorted(json.loads(x)["attempt"]["op"] for x in lines) == sorted(OPS)
    from model.registry import Registry

    reg = Registry(run["registry"])
    for op in OPS:
        assert reg.variants(op) == ["template_tiles_v1"]
        rec = reg.read_record(op, "template_tiles_v1")
        # CPU rule: registered as candidate, speed not judged, never locked.
        assert rec.status == "candidate" and rec.optimize["speed_judged"] is False
        assert rec.verdicts() == {"cpu": "pass"}
        assert all(not b.meaningful for b in rec.benchmarks)
        # Tuned configs wait in the record until the variant is accepted.
        assert rec.proposed_configs and not reg.config_path(op, "template_tiles_v1").exists()
        notes = (reg.root / op / "NOTES.md").read_text()
        assert "Hypothesis:" in notes and "Prediction:" in notes and "Result:" in notes
        assert (run["dir"] / "ops" / op / "optuna.journal").is_file()
    assert not reg.lock_path.exists()
    e2e = st["e2e"]
    assert e2e["ran"] and e2e["parity"] and e2e["top1_agree"]
    assert set(e2e["sources"]) == set(OPS)
    report = (run["dir"] / "report.md").read_text()
    assert "speed was not judged" in report and "End-to-end check" in report
    for png in ("time_per_op", "speedup_per_op", "candidate_history"):
        assert (run["dir"] / "plots" / f"{png}.png").stat().st_size > 1000
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
    """The first markdown table under `heading`: op -> its cells."""
    section = report.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("| ") and not ln.startswith("| op")]
    return {cells[0].strip("* "): cells[1:]
            for cells in ([c.strip() for c in ln.strip("|").split("|")] for ln in rows)}


def test_report_compares_the_reference_set_with_the_tuned_set(run):
    """Issue 6: `autoopt profile --compare profile_reference.json profile_after.json` is in the
    report, its numbers are the two JSON profiles', and the plot is drawn."""
    d = run["dir"]
    st = json.loads((d / "state.json").read_text())
    assert st["profile_reference"] == "profile_reference.json"
    ref = json.loads((d / "profile_reference.json").read_text())
    after = json.loads((d / "profile_after.json").read_text())
    assert ref["kernels"] == "reference" and after["kernels"].endswith("e2e.lock.toml")
    assert (ref["batch"], ref["layers"], ref["backend"]) == (
        after["batch"], after["layers"], after["backend"])
    assert set(OPS) <= {op for op, s in after["sources"].items() if s != "reference"}
    assert (d / "plots" / "reference_vs_tuned.png").stat().st_size > 1000
    report = (d / "report.md").read_text()
    heading = ("## Reference vs tuned (autoopt profile --compare profile_reference.json "
               "profile_after.json)")
    assert heading in report and "(plots/reference_vs_tuned.png)" in report
    assert "## Profile: before" in report  # the before/after section stays
    table = _md_table(report, heading)
    rows_a = {r["op"]: r for r in ref["rows"]}
    rows_b = {r["op"]: r for r in after["rows"]}
    assert set(table) == set(rows_a) | set(rows_b) | {"step"}
    for op, cells in table.items():
        if op == "step":
            ta, tb = ref["step_us"], after["step_us"]
        else:
            ta = rows_a[op]["time_us"] if op in rows_a else None
            tb = rows_b[op]["time_us"] if op in rows_b else None
        # The report rounds times to 0.1 µs and the speedup to 0.01: compare the same rounding.
        assert cells[0] == ("-" if ta is None else f"{ta:.1f}"), op
        assert cells[1] == ("-" if tb is None else f"{tb:.1f}"), op
        assert cells[2] == (f"{ta / tb:.2f}x" if ta and tb else "-"), op
    speed = ref["step_us"] / after["step_us"]
    assert (f"Whole step: reference {ref['step_us']:.1f} µs, tuned {after['step_us']:.1f} µs "
            f"({speed:.2f}x)") in report
