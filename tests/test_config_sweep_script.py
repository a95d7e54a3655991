"""benchmarks/config_sweep_gpu.py on CPU: its dry run end to end, and the best config per T it
hands to `autoopt registry tune`."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    out = json.loads((tmp_path / "results.json").read_text())
    assert (out["op"], out["variant"]) == ("router", "triton_v2")
    timed = [r for r in out["rows"] if r["impl"] == "triton_v2"]
    assert len(timed) == 2 and all("error" not in r and r["ids_off"] == 0 for r in timed), timed


def _best():
    spec = importlib.util.spec_from_file_location("sweep_best", ROOT / "benchmarks"
                                                  / "sweep_best.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sweeps_best_configs_merge_into_one_tune(tmp_path, capsys):
    def sweep(name, best, variant="triton_v5"):
        path = tmp_path / name / "results.json"
        path.parent.mkdir()
        path.write_text(json.dumps({"op": "router", "variant": variant, "rows": [],
                                    "best": best}))
        return str(path)

    warps = sweep("a", {"T=1": {"SEL_WARPS": 8}, "T=16": {}})
    gemm = sweep("b", {"T=64": {"BLOCK_E": 32}, "T=32": {"BLOCK_E": 64}})
    again = sweep("c", {"T=1": {"SEL_WARPS": 4}, "T=2048": {}})
    # Buckets in token order, the defaults' buckets null, a bucket swept twice the later best.
    assert _best().main([warps, gemm, again, str(tmp_path / "missing.json")]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == {"T=1": {"SEL_WARPS": 4}, "T=16": None, "T=32": {"BLOCK_E": 64},
                               "T=64": {"BLOCK_E": 32}, "T=2048": None}
    assert list(json.loads(out)) == ["T=1", "T=16", "T=32", "T=64", "T=2048"]
    assert "missing.json is missing" in err
    # Nothing to tune, or sweeps of two variants: refused.
    assert _best().main([sweep("d", {"T=1": {}})]) == 1
    with pytest.raises(ValueError, match="different variants"):
        _best().main([warps, sweep("e", {"T=8": {"B": 1}}, variant="triton_v4")])
