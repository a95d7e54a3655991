"""benchmarks/moe_gpu.py, the H200 script for moe_experts, exercised on CPU (--dry-run)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from model.registry import Registry, shipped_root

DEFAULT_ROOT = shipped_root()


def load_script():
    path = DEFAULT_ROOT.parent / "benchmarks" / "moe_gpu.py"
    spec = importlib.util.spec_from_file_location("moe_gpu_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_plan_sweeps_each_kernel_apart_at_rank_shapes():
    script = load_script()
    assert script.RANK == {"H": 5120, "E": 256, "I": 320, "k": 8}
    assert script.TOKENS == (1, 2, 4, 8, 16, 32, 64, 2048)
    decode = script.sweep_configs(1, 8)
    assert len(decode["A"]) == len(script.A_SWEEP) and len(decode["B"]) == len(script.B_SWEEP)
    assert not decode["G"] and all(c["PATH"] == "decode" for c in decode["A"] + decode["B"])
    # Every A config keeps kernel B fixed and vice versa: each stage times one kernel's configs.
    assert len({json.dumps({k: c[k] for k in script.B_SWEEP[0]}) for c in decode["A"]}) == 1
    assert len({json.dumps({k: c[k] for k in script.A_SWEEP[0]}) for c in decode["B"]}) == 1
    prefill = script.sweep_configs(2048, 8)
    assert not prefill["A"] and len(prefill["G"]) == len(script.G_SWEEP)
    # Every swept value is one the variant declares (what the template agent may tune).
    space = Registry().load_variant("moe_experts", "triton_v1").CONFIG_SPACE
    for cfg in [c for t in (1, 64, 2048) for cs in script.sweep_configs(t, 8).values()
                for c in cs]:
        assert all(v in space[k] for k, v in cfg.items()), cfg


@pytest.mark.slow
def test_dry_run_checks_times_sweeps_and_writes(tmp_path, capsys):
    script = load_script()
    code = script.main(["--dry-run", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    res = json.loads((tmp_path / "results.json").read_text())
    assert sorted(res["tokens"]) == ["1", "3"]
    for row in res["tokens"].values():
        assert all(c["pass"] for c in row["correct"].values())
        assert {"reference", "grouped_mm_v2", "triton_v1"} <= set(row["time"])
        assert {r["stage"] for r in row["sweep"]} == {"A", "B", "G"}
        assert all(r["correct"]["pass"] for r in row["sweep"])
    md = (tmp_path / "results.md").read_text()
    assert "## sweep T=3" in md and "| 3 | triton_v1 |" in md
    assert out.strip().splitlines()[0].startswith("T ") and len(out.strip().splitlines()) == 3


def test_quick_sweep_fits_and_declares_its_values():
    script = load_script()
    space = Registry().load_variant("moe_experts", "triton_v1").CONFIG_SPACE
    for t in script.TOKENS:
        cands = script.quick_configs(t)
        assert 1 <= len(cands) <= (8 if t <= 8 else 4), t
        assert len({json.dumps(c, sort_keys=True) for c in cands}) == len(cands), t
        for cfg in cands:
            assert all(v in space[k] for k, v in cfg.items()), cfg
            assert cfg["PATH"] == "grouped" or t * 8 <= 1024


@pytest.mark.slow
def test_quick_candidates_compute_the_same_function():
    # Every --quick candidate (its tiles as given, on tiny widths) within the policy of the
    # reference on skewed routing with a hot expert, so the sweep only picks a speed.
    import sys

    sys.path.insert(0, str(DEFAULT_ROOT.parent / "tests"))
    from test_kernels_moe import check, inputs

    script = load_script()
    run = Registry().load_variant("moe_experts", "triton_v1").run
    seen = set()
    for t in (1, 2, 4, 8, 16):
        args = inputs(t, 96, 16, 48, 8, t, "skewed")
        for cfg in script.quick_configs(t):
            key = json.dumps({k: v for k, v in cfg.items() if k not in ("PDL", "PREFETCH")},
                             sort_keys=True)
            if (t, key) in seen:
                continue  # PDL and PREFETCH are GPU-only launch options: the same CPU program
            seen.add((t, key))
            check(run(*args, config=cfg), args)


@pytest.mark.slow
def test_quick_dry_run_writes_best_configs(tmp_path, capsys):
    script = load_script()
    assert script.main(["--dry-run", "--quick", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert sorted(res["best_configs"]) == ["T=1", "T=3"]
    space = Registry().load_variant("moe_experts", "triton_v1").CONFIG_SPACE
    for row in res["tokens"].values():
        assert [r["stage"] for r in row["sweep"]] == ["default", "Q", "Q"]
        assert all(r["correct"]["pass"] for r in row["sweep"])
    for cfg in res["best_configs"].values():
        assert set(cfg) <= set(space)
