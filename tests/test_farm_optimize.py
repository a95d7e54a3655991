"""`autoopt optimize --target cpu-tiny` with two sessions per op on two CPU workers, and on a
local Ray cluster with two workers, verify and register the same candidates as a single-worker
run: the same verdicts per candidate, and a registry identical apart from times, run ids and
measured profile numbers. The template agent with a fixed seed makes the runs comparable."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autoopt.cli import app

OPS = ("swiglu", "attn_output_gate")
FAST = ["--target", "cpu-tiny", "--agent", "template", "-O", "seed=7", "-O", "trials=0",
        "--ops", ",".join(OPS), "--max-candidates", "2", "--layers", "2", "--verify-seeds",
        "1", "--verify-tokens", "5", "--no-e2e", "--budget", "20m"]


def _optimize(root: Path, name: str, *extra: str) -> dict:
    reg, runs = root / name / "registry", root / name / "runs"
    res = CliRunner().invoke(app, ["optimize", *FAST, "--registry", str(reg), "--runs-dir",
                                   str(runs), *extra])
    assert res.exit_code == 0, res.output
    (run_dir,) = list(runs.iterdir())
    state = json.loads((run_dir / "state.json").read_text())
    attempts = [json.loads(x) for x in (run_dir / "attempts.jsonl").read_text().splitlines()]
    return {"dir": run_dir, "registry": reg, "state": state, "attempts": attempts,
            "log": (run_dir / "run.log").read_text()}


_DROP = {"time", "git_commit", "run", "profile_row", "floor_us", "report", "benchmarks",
         "elapsed_s"}


def _strip(x):
    if isinstance(x, dict):
        return {k: _strip(v) for k, v in x.items() if k not in _DROP}
    if isinstance(x, list):
        return [_strip(v) for v in x]
    return x


def _registry(root: Path) -> dict[str, object]:
    out: dict[str, object] = {}
    for p in sorted(root.rglob("*")):
        if not p.is_file():
            continue
        key = str(p.relative_to(root))
        if p.suffix == ".json":
            out[key] = _strip(json.loads(p.read_text()))
        elif p.name == "NOTES.md":
            out[key] = re.sub(r"\(\d{4}-\d\d-\d\dT[\d:]+, (.*?), run [\w-]+\)", r"(\1)",
                              p.read_text())
        else:
            out[key] = p.read_bytes()
    return out


def _verdicts(run: dict) -> dict[tuple[str, str], str]:
    return {(a["attempt"]["op"], a["attempt"]["sha256"]): a["attempt"]["verdict"]
            for a in run["attempts"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("farm")
    return {"single": _optimize(root, "single"),
            "sessions": _optimize(root, "sessions", "--sessions", "2", "--workers", "2"),
            "ray": _optimize(root, "ray", "--sessions", "2", "--workers", "2",
                             "--ray-address", "local")}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sessions", "ray"])
def test_many_sessions_and_workers_register_what_one_worker_does(runs, kind):
    single, other = runs["single"], runs[kind]
    assert _verdicts(single) and set(_verdicts(single).values()) == {"pass"}
    assert _verdicts(other) == _verdicts(single)
    assert _registry(other["registry"]) == _registry(single["registry"])
    names = {p.name for p in other["registry"].rglob("*.py")}
    assert names == {"template_tiles_v1.py"}
    farm = {"sessions": "local farm, 2 worker(s): cpu, cpu",
            "ray": "ray farm, 2 worker(s): ray:cpu0, ray:cpu1"}[kind]
    assert farm in other["log"] and "2 session(s) per op, 2 op(s) at a time" in other["log"]
    for op in other["state"]["ops"]:
        assert op["status"] == "done" and len(op["session"]["sessions"]) == 2


@pytest.mark.slow
def test_device_time_is_accounted_live_and_in_the_report(runs):
    for kind, run in runs.items():
        costs = run["state"]["costs"]
        jobs = sum(w["jobs"] for w in costs["device"].values())
        assert jobs == len(run["attempts"]), kind  # one eval job per candidate on CPU
        assert all(w["seconds"] > 0 for w in costs["device"].values())
        assert costs["api"] == {}  # the template agent calls no API
        assert "spent: device" in run["log"]
        report = (run["dir"] / "report.md").read_text()
        assert "## Cost" in report and f"over {jobs} job(s)" in report
    workers = set(runs["ray"]["state"]["costs"]["device"])
    assert len(workers) >= 1 and all("/cpu" in w for w in workers)
