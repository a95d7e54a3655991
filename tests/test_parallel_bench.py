"""benchmarks/tp_bench.py --dry-run on CPU/gloo: spawned by its own launcher and under torchrun."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks" / "tp_bench.py"


def _check(result: dict, fused: bool) -> None:
    meta = result["meta"]
    assert meta["tp"] == 2 and meta["backend"] == "gloo" and meta["dry_run"]
    assert meta["devices"] == ["cpu", "cpu"] or len(meta["devices"]) == 2
    impls = {row["impl"] for row in result["boundary"]}
    assert {"gather", "allreduce", "oneshot", "comm:allreduce", "comm:allgather",
            "compute:gather", "compute:norm_residual_norm"} <= impls
    # gloo: the one-shot boundary takes its all-gather fallback (no peer buffers, no comm row).
    assert "gather fallback" in meta["boundary_note"] and "comm:oneshot" not in impls
    assert {row["tokens"] for row in result["boundary"]} == {1, 17}
    assert all(row["median_us"] > 0 for row in result["boundary"])
    # At TP=2 both boundaries equal the op's reference bitwise, on every rank.
    assert result["verify"] and all(row["all_ranks_bitwise"] for row in result["verify"])
    steps = result["step"]
    impls = ("gather", "allreduce", "oneshot")
    assert {(row["impl"], row["batch"]) for row in steps} == {(i, b) for i in impls for b in (1, 2)}
    # The floor: no bandwidth ceiling on the CPU, but the communication floor is measured.
    assert all(row["floor_ms"] is None and row["comm_floor_ms"] > 0 for row in steps)
    assert all(row["bytes_read"]["experts"] > 0 and row["bytes_read"]["kv"] > 0 for row in steps)
    if fused:
        timed = {row["impl"] for row in result["boundary"]}
        assert {"gather+fused", "compute:gather+fused"} <= timed
    assert all(row["median_ms"] > 0 and row["logits_equal_to_first_impl"] for row in steps)


@pytest.mark.parametrize("runner", ["spawn", "torchrun"])
def test_tp_bench_dry_run(tmp_path, runner):
    cmd = [sys.executable, str(BENCH), "--dry-run", "--out", str(tmp_path / "out")]
    if runner == "torchrun":
        cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    else:
        # A stand-in "fused" variant file (the op's reference under the variant entry point).
        variant = tmp_path / "variant.py"
        variant.write_text("from model.ops.allreduce_norm_residual_norm import reference as run\n")
        cmd += ["--fused", str(variant)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    _check(json.loads((tmp_path / "out" / "tp_bench.json").read_text()), runner == "spawn")
