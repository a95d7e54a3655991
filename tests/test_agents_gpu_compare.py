"""benchmarks/agents_gpu.py's rule for `profile_candidate` against `ncu` run by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("agents_gpu", ROOT / "benchmarks/agents_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _kernel(**kw):
    k = {"name": "k", "registers": 32, "smem_per_block": 0, "block": 128, "grid": 160,
         "dram_bytes": 5_291_264, "duration_us": 9.9, "occupancy_pct": 7.0, "l2_hit_pct": 16.0}
    return {**k, **kw}


def test_identical_launches_and_close_measurements_pass():
    m = _module()
    assert m.compare([_kernel()], [_kernel(duration_us=9.1, occupancy_pct=7.2)])["passed"]


def test_a_small_kernels_dram_bytes_get_an_absolute_slack_a_large_ones_do_not():
    # Measured on an H200: a 200 KB copy read 195,840 then 220,672 bytes (L2 state).
    m = _module()
    small = m.compare([_kernel(dram_bytes=195_840)], [_kernel(dram_bytes=220_672)])
    assert small["passed"], small
    big = m.compare([_kernel(dram_bytes=5_291_264)], [_kernel(dram_bytes=5_700_000)])
    assert not big["passed"] and "dram_bytes" in big["kernels"][0]["differences"]
    far = m.compare([_kernel(dram_bytes=100_000)], [_kernel(dram_bytes=200_000)])
    assert not far["passed"]


def test_any_launch_difference_or_missing_kernel_fails():
    m = _module()
    assert not m.compare([_kernel()], [_kernel(registers=40)])["passed"]
    assert not m.compare([_kernel(), _kernel()], [_kernel()])["passed"]
    assert not m.compare([], [])["passed"]
    assert not m.compare([_kernel()], [_kernel(dram_bytes=None)])["passed"]
