"""benchmarks/attention_gpu.py's CPU dry run: the GPU script's code, on tiny shapes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _script():
    spec = importlib.util.spec_from_file_location("attention_gpu",
                                                  REPO / "benchmarks" / "attention_gpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["attention_gpu"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_dry_run_writes_every_section(tmp_path, capsys):
    assert _script().main(["--dry-run", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "attention_gpu.json").read_text())
    assert res["env"]["meaningful"] is False
    assert len(res["attention"]) == 8  # 2 layer kinds x 2 contexts x 2 batches
    for row in res["attention"]:
        for impl in ("torch", "triton_v1"):
            assert row[impl]["max_ulp"] == 0, row  # the interpreter keeps the reference's bits
            assert row[impl]["vs_near"] > 0  # and the fp32_probs near miss is told apart
    assert [r["T"] for r in res["qkv"]] == [1, 3, 17]
    assert all(r[v]["max_ulp"] <= 1 for r in res["qkv"] for v in ("triton_v1", "triton_v2"))
    assert [r["T"] for r in res["gated_o_proj"]] == [1, 3, 17]
    assert all(r["template_splitk_v1"]["max_ulp"] <= 1 and r["gate_kernel_cublas_us"] > 0
               for r in res["gated_o_proj"])
    assert {r["op"] for r in res["qk_norm"]} == {"qk_norm_rope", "qk_norm_ssmax"}
    assert all(r["v_cache_bitwise"] for r in res["qk_norm"])
    md = (tmp_path / "attention_gpu.md").read_text()
    assert "| full | 40 | 1 | triton_v1 |" in md and "kernels per block" in capsys.readouterr().out


@pytest.mark.slow
def test_quick_dry_run_times_decode_attention_and_sweeps_configs(tmp_path, capsys):
    assert _script().main(["--quick", "--dry-run", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "attention_gpu.json").read_text())
    assert res["env"]["quick"] is True and "qkv" not in res  # decode attention only
    assert len(res["attention"]) == 8
    assert all(r[impl]["ok"] for r in res["attention"] for impl in ("torch", "triton_v1"))
    assert all("flashinfer_v1" not in r for r in res["attention"])
    # 2 configs x (full at 2 contexts, window once) x batch 1 and 8, each checked
    assert len(res["sweep"]) == 12 and all(r["ok"] for r in res["sweep"]), res["sweep"]
    assert set(res["best_configs"]) == {f"{layer} ctx {ctx} bs {bs}" for layer, ctx in
                                        (("full", 40), ("full", 300), ("window", 300))
                                        for bs in (1, 8)}
    out = capsys.readouterr().out
    assert "best full ctx 300 bs 1:" in out
