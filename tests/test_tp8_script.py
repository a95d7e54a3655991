"""benchmarks/tp8_run.py --dry-run on CPU: the one-GPU mode and the multi-GPU mode's stages."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "tp8_run.py"


def _run(tmp_path: Path, *args: str) -> tuple[Path, str]:
    out = tmp_path / "out"
    cmd = [sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), "--work",
           str(tmp_path / "work"), *args]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


def test_one_gpu_mode_checks_the_kernel(tmp_path):
    out, printed = _run(tmp_path, "--gpus", "1")
    sim = json.loads((out / "sim.json").read_text())
    assert {(r["R"], r["T"]) for r in sim["rows"]} == {(2, 1), (2, 3), (3, 1), (3, 3)}
    keys = ("triton_v1_bitwise", "oneshot_stacked_bitwise", "oneshot_ranks_bitwise")
    assert all(r[k] for r in sim["rows"] for k in keys)
    run = json.loads((out / "tp8_run.json").read_text())
    assert [s["stage"] for s in run["stages"] if s["ran"]] == ["sim"]
    assert run["env"] == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    assert "sim      R=3 T=3     bitwise True" in printed


@pytest.mark.slow
def test_two_gpu_mode_runs_every_stage(tmp_path):
    out, printed = _run(tmp_path, "--gpus", "2", "--stages", "parity,boundary,steps,serve")
    parity = json.loads((out / "parity.json").read_text())
    assert parity["fp32_greedy_equal"] and parity["ranks_identical"]
    assert parity["bf16_oneshot_equals_gather"] and parity["fp32_max_abs_logit_diff"] < 1e-4
    bench = json.loads((out / "boundary" / "tp_bench.json").read_text())
    assert {r["tokens"] for r in bench["verify"]} == {1, 3}
    assert all(r["all_ranks_bitwise"] for r in bench["verify"])
    assert {"allreduce", "gather+fused", "oneshot"} <= {r["impl"] for r in bench["verify"]}
    steps = json.loads((out / "steps" / "tp_bench.json").read_text())
    assert {(r["impl"], r["batch"]) for r in steps["step"]} == {
        (i, b) for i in ("gather", "allreduce", "oneshot") for b in (1, 2)}
    serve = json.loads((out / "serve.json").read_text())
    assert serve["returncode"] == 0 and len(serve["result"]["token_ids"]) == 4
    assert "parity   TP2 vs TP1: FP32 greedy equal True" in printed
