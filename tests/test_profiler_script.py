"""benchmarks/gpu_profile.py --dry-run: the H200 run (bench model tables and a served-step
profile), on the CPU with cpu-tiny."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from autoopt import env
from autoopt.profiler.attribution import Profile


def _script():
    path = env.REPO_ROOT / "benchmarks" / "gpu_profile.py"
    spec = importlib.util.spec_from_file_location("gpu_profile", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_dry_run_writes_few_flat_files(tmp_path: Path, capsys):
    out = tmp_path / "out"
    assert _script().main(["--dry-run", "--skip-compile", "--out", str(out)]) == 0
    files = sorted(p.name for p in out.iterdir())
    assert all(p.is_file() for p in out.iterdir()) and len(files) <= 12
    assert {"summary.txt", "bench_decode.json", "bench_decode.md", "bench_decode.png",
            "bench_prefill.json", "profile-b1.json", "profile-b3.png"} <= set(files)
    decode = json.loads((out / "bench_decode.json").read_text())
    # Both contexts in one table, from one process: the long context at its own batches.
    assert {(r["context"], r["batch"]) for r in decode["rows"]} == {(40, 1), (40, 3), (64, 1)}
    assert decode["kernels"] == ["reference", "tuned"] and all(r["ran"] for r in decode["rows"])
    prefill = json.loads((out / "bench_prefill.json").read_text())
    assert prefill["phase"] == "prefill" and prefill["rows"][0]["batch"] == 2
    prof = Profile.load(out / "profile-b3.json")
    assert prof.batch == 3 and prof.kernels == "tuned" and abs(
        sum(r.share for r in prof.rows) - 100) <= 0.5
    text = (out / "summary.txt").read_text()
    assert "total" in text and "error" not in text
    assert "== decode bench:" in capsys.readouterr().out  # per-stage timings are printed


@pytest.mark.slow
def test_profile_stage_adds_the_compile_sets_step(tmp_path: Path):
    # Op by op, where Inductor's kernels beat the registry's: the compile set's step at the
    # first profiled batch, beside the tuned set's.
    script = _script()
    run = script.Run(tmp_path, 300.0, False)
    profs = script._profile(run, "cpu-tiny", script.DRY, True)
    assert [p.batch for p in profs] == [1, 3] and all(p.kernels == "tuned" for p in profs)
    comp = Profile.load(tmp_path / "profile-compile-b1.json")
    assert comp.kernels == "compile" and comp.batch == 1
    assert {r.op for r in comp.rows} & {"rmsnorm", "router", "moe_experts"}


def test_the_compile_peer_runs_at_both_decode_contexts(tmp_path: Path, monkeypatch):
    # The peer users would reach for belongs in every table the tuned set is in: the long
    # context as well as the short one, and prefill.
    from types import SimpleNamespace

    script = _script()
    calls = []

    def fake_bench(run, stem, target, batches, contexts, sets, budget, phase=None, layers=None,
                   before=None):
        calls.append((stem, tuple(batches), tuple(contexts), tuple(sets)))
        return before or SimpleNamespace(layers=2)

    monkeypatch.setattr(script, "_bench", fake_bench)
    monkeypatch.setattr(script, "_profile", lambda *a: [])
    monkeypatch.setattr(script, "_summary", lambda *a: 0)
    assert script.main(["--dry-run", "--out", str(tmp_path)]) == 0
    _, batches, ctxs, long_batches, long_ctx = script.DRY["decode"]
    compile_rows = [c for c in calls if "compile" in c[3]]
    assert ("bench_decode", batches, ctxs, ("compile", "tuned+compile")) in compile_rows
    assert ("bench_decode", long_batches, (long_ctx,), ("compile", "tuned+compile")) in \
        compile_rows
    assert any(c[0] == "bench_prefill" for c in compile_rows)
