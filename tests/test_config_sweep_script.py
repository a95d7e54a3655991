"""benchmarks/config_sweep_gpu.py on CPU: its dry run end to end, and the best config per T it
hands to `autoopt registry tune`."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "config_sweep_gpu.py"


def _script():
    spec = importlib.util.spec_from_file_location("config_sweep_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_best_config_per_t_from_an_h200_sweep():
    rows = json.loads((ROOT / "docs" / "gpu-runs" / "2026-12-04-h200-5" / "moe-v3-sweep"
                       / "results.json").read_text())["rows"]
    best = _script().best_configs(rows, "triton_v3")
    want = {"A_WARPS": 4, "BLOCK_K": 1024, "BLOCK_N": 4, "SPLIT_K": 1}
    assert best == {"T=1": want, "T=2": want}


def test_the_defaults_and_failed_configs_are_never_best():
    shape = {"T": 8}
    rows = [{"shape": shape, "impl": "reference", "us": 1.0},
            {"shape": shape, "impl": "v", "config": {}, "us": 5.0},
            {"shape": shape, "impl": "v", "config": {"B": 2}, "error": "CompilationError"},
            {"shape": shape, "impl": "v", "config": {"B": 4}, "us": 6.0},
            {"shape": {"T": 1}, "impl": "v", "config": {"B": 1}, "error": "x"}]
    assert _script().best_configs(rows, "v") == {"T=1": {}, "T=8": {}}


def test_dry_run_writes_the_best_configs_and_the_tune_command(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--op", "swiglu", "--variant", "triton_v2", "--tokens", "1",
         "--grid", '{"BLOCK": [256, 512]}', "--iters", "1", "--dry-run", "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads((tmp_path / "results.json").read_text())
    assert set(out["best"]) == {f"T={r['shape']['T']}" for r in out["rows"]}  # dense, experts (T*k)
    assert all(c in ({}, {"BLOCK": 256}, {"BLOCK": 512}) for c in out["best"].values())
    tune = "autoopt registry tune swiglu triton_v2 --target h200-tp8-decode"
    assert (tune in proc.stdout) == any(out["best"].values()), proc.stdout[-1000:]


def test_integer_outputs_are_counted_not_measured_in_ulps():
    # The router returns expert ids (int64) beside FP32 weights: ulps are undefined for the ids,
    # so the sweep counts the ids that differ (every config raised here before).
    import torch

    diff = _script().differences
    ids, w = torch.tensor([[3, 1], [7, 2]]), torch.tensor([[0.5, 0.25], [0.75, 0.125]])
    same = diff((ids.clone(), w.clone()), (ids, w))
    assert same == {"max_ulp": 0, "ids_off": 0}
    moved = ids.clone()
    moved[1, 0] = 9
    nudged = w.clone()
    nudged[0, 1] = torch.nextafter(w[0, 1], torch.tensor(1.0))
    assert diff((moved, nudged), (ids, w)) == {"max_ulp": 1, "ids_off": 1}
    assert diff((w,), (w,)) == {"max_ulp": 0}  # a float-only op reports no id count


def test_dry_run_sweeps_the_router(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--op", "router", "--variant", "triton_v2", "--tokens", "1",
         "--grid", '{"BLOCK_E": [4]}', "--iters", "1", "--dry-run", "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    timed = [r for r in rows if r["impl"] == "triton_v2"]
    assert len(timed) == 2 and all("error" not in r and r["ids_off"] == 0 for r in timed), timed
