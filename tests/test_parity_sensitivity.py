"""benchmarks/parity_sensitivity.py: one BF16 ulp, carried through a random-weight Beam."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def load_script():
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "parity_sensitivity.py"
    spec = importlib.util.spec_from_file_location("parity_sensitivity_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_one_ulp_reaches_the_logits_and_can_change_the_top_token():
    r = load_script().one_ulp_effect(layers=8, hidden=64, prompts=4)
    assert r["prompts"] == 4 and 0 <= r["top1_flips"] <= 4
    # The nudge is real: every prompt's logits moved, none by more than they are large.
    assert 0 < r["max_diff_median"] <= r["max_diff_max"] < 2 * r["logit_scale"]
