"""benchmarks/reduction_check.py, the GPU check of the reference's GEMM reductions, on CPU."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "reduction_check.py"


def _script():
    spec = importlib.util.spec_from_file_location("reduction_check_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dry_run_compares_both_references_and_every_variant(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    script = _script()
    assert script.main(["--dry-run", "--seeds", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert {r["op"] for r in rows} == {"moe_experts", "attention"}
    for r in rows:
        # On the CPU there is no cuBLAS: both references agree, and so does every variant.
        assert r["strict_vs_default"] == {"mismatch_fraction": 0.0, "max_ulp": 0}
        for v in script.VARIANTS[r["op"]]:
            assert r[v]["vs_strict"]["max_ulp"] <= 1, (v, r[v])


def test_a_variant_that_differs_is_counted(monkeypatch):
    # The comparison counts differences in ulps at the op's scale: an output moved by one ulp
    # everywhere is a mismatch fraction of 1.
    import torch

    script = _script()
    ref = torch.randn(4, 8).to(torch.bfloat16)
    moved = (ref.view(torch.int16) + 1).view(torch.bfloat16)
    row = script.compare(moved, ref, None)
    assert row["mismatch_fraction"] == 1.0 and row["max_ulp"] >= 1
    assert script.compare(ref, ref, None) == {"mismatch_fraction": 0.0, "max_ulp": 0}


@pytest.mark.parametrize("spec,config", [("triton_v1", None),
                                         ("triton_v1@PATH=grouped,MMA=false",
                                          {"PATH": "grouped", "MMA": False})])
def test_variant_specs_set_config_keys(spec, config, monkeypatch):
    script = _script()
    seen = {}
    monkeypatch.setattr(script, "load_variant",
                        lambda op, name: lambda *a, config=None: seen.update(config=config))
    script.variant_call("moe_experts", spec)(1, 2)
    assert seen["config"] == config
