"""The emulation behind triton_v5's accumulation (benchmarks/router_tc_rounding.py): with tensor
cores that truncate their FP32 sums, one accumulator through all of K fails the router's policy
and a fresh sum each K step added in FP32 on the CUDA cores keeps it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import router_tc_rounding as rtc  # noqa: E402


def test_split_terms_sum_to_the_weight():
    w = np.random.default_rng(0).standard_normal(10000).astype(np.float32) * 0.02
    terms = rtc.split3(w)
    assert np.array_equal(sum(t.astype(np.float64) for t in terms), w.astype(np.float64))


def test_one_accumulator_fails_and_per_step_keeps_the_policy(tmp_path):
    assert rtc.main(["--out", str(tmp_path), "--tokens", "32", "--seeds", "0,1"]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())
    by = {}
    for r in rows:
        by.setdefault(r["mode"], []).append(r)
    assert set(by) == set(rtc.MODES) and all(len(v) == 2 for v in by.values())
    for r in by["one_accumulator"]:  # truncation against the running logit: biased, too far
        assert not r["passes"] and r["weights_max_ulp"] > 16 and r["logit_err_mean"] < -1
    for mode in ("per_step", "fp32_chunks"):
        for r in by[mode]:
            assert r["passes"] and r["weights_max_ulp"] <= 8, r
            assert abs(r["logit_err_mean"]) < 0.1 and r["logit_err_max"] < 1, r
