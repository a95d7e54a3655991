"""The adversarial corpus (tests/adversarial/): every cheating or broken variant is rejected for
the right reason by the full sandboxed verifier, and the honest variants (plain torch and a
Triton kernel under TRITON_INTERPRET=1) pass.

All variants are verified once per session, a few children at a time (a child costs a few
seconds of torch import), on small odd shapes.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from autoopt.eval.shapes import cpu_shapes
from autoopt.eval.verify import VerifyReport, verify_variant

CORPUS = Path(__file__).resolve().parent / "adversarial"
TOKENS = (1, 17)
SEEDS = (0, 1)
# A hang is detected by the sandbox's timeout; short here, long enough for the child's start.
HANG_TIMEOUT_S = 20.0

# file stem -> (op, substrings that must all appear among the rejection reasons)
REJECTED: dict[str, tuple[str, tuple[str, ...]]] = {
    "returns_zeros": ("swiglu", ("output 0 is all zeros",)),
    "returns_constant": ("attn_output_gate", ("output 0 is constant", "not input dependent")),
    "stale_allocator": ("swiglu", ("not written (NaN poison survived)",)),
    "mutates_input": ("swiglu", ("mutated input 0 (gate)", "mutated input")),
    "side_stream": ("swiglu", ("static screen: uses CUDA streams (side-stream work)",)),
    "pointer_cache": ("attn_output_gate", ("caches outputs by data pointer",)),
    "near_miss_two_step": ("swiglu", ("closer to near miss 'bf16_two_step'",)),
    "lower_precision": ("rmsnorm", ("numerics: output 0", "> 1 ulp")),
    "partial_write": ("logit_softcap", ("not written (NaN poison survived)",)),
    "returns_input": ("swiglu", ("output 0 aliases input 0 (gate)",)),
    "nondeterministic": ("swiglu", ("nondeterministic: two runs differ",)),
    "imports_reference": ("swiglu", ("static screen: imports the reference (model.ops.swiglu)",)),
    "file_io": ("swiglu", ("static screen: uses open() (file I/O)",)),
    "network": ("swiglu", ("static screen: imports urllib (network)",)),
    "subprocess_use": ("swiglu", ("static screen: imports subprocess",)),
    "hangs": ("swiglu", ("timeout after",)),
    "wrong_dtype": ("logit_softcap", ("wrong dtype/shape: output 0 is bfloat16",)),
    "wrong_shape": ("rmsnorm", ("wrong dtype/shape: output 0 is bfloat16 [320]",)),
    "patches_timers": ("swiglu", ("static screen: monkeypatches time.perf_counter",
                                  "static screen: monkeypatches torch.cuda.Event")),
    "dynamic_import": ("swiglu", ("static screen: calls __import__",)),
    "uses_torch_compile": ("swiglu", ("static screen: uses torch.compile",)),
    "tensor_subclass": ("swiglu", ("static screen: defines __torch_function__",)),
}
PASSING: dict[str, str] = {
    "honest_torch_swiglu": "swiglu",
    "honest_triton_swiglu": "swiglu",
    "honest_torch_rmsnorm": "rmsnorm",
}


def _verify(item: tuple[str, str]) -> tuple[str, VerifyReport]:
    stem, op = item
    timeout = HANG_TIMEOUT_S if stem == "hangs" else 300.0
    shapes = cpu_shapes(op, TOKENS)
    return stem, verify_variant(op, CORPUS / f"{stem}.py", device="cpu", seeds=SEEDS,
                                shapes=shapes, timeout_s=timeout)


@pytest.fixture(scope="session")
def reports() -> dict[str, VerifyReport]:
    items = [(s, op) for s, (op, _) in REJECTED.items()] + list(PASSING.items())
    with ThreadPoolExecutor(max(2, min(4, os.cpu_count() or 2))) as pool:
        return dict(pool.map(_verify, items))


def test_corpus_is_complete():
    files = {p.stem for p in CORPUS.glob("*.py")}
    assert files == set(REJECTED) | set(PASSING), "every corpus file needs an expectation"
    assert len(REJECTED) >= 16


@pytest.mark.parametrize("stem", sorted(REJECTED))
def test_rejected_for_the_right_reason(reports, stem):
    report = reports[stem]
    _, expected = REJECTED[stem]
    assert report.verdict == "reject"
    text = "\n".join(report.reasons)
    for needle in expected:
        assert needle in text, f"{stem}: expected {needle!r} among reasons:\n{text}"


@pytest.mark.parametrize("stem", sorted(PASSING))
def test_honest_variants_pass(reports, stem):
    report = reports[stem]
    assert report.verdict == "pass", report.reasons
    assert report.checks["numerics"]["passed"]
    near = report.checks["near_misses"]["by_name"]
    assert near and all(d["status"] != "closer to the near miss" for d in near.values())
    assert report.checks["sandbox"]["blocked"] == []


def test_static_rejections_never_start_a_child(reports):
    # Hostile source is refused before any of it runs: no sandbox entry in the report.
    for stem in ("imports_reference", "subprocess_use", "network", "file_io", "patches_timers"):
        assert "sandbox" not in reports[stem].checks
        assert reports[stem].checks["static_screen"]["passed"] is False


def test_cpu_policy_of_a_bitwise_op_is_stated(reports):
    out = reports["honest_triton_swiglu"].checks["numerics"]["outputs"][0]
    assert out["policy"].startswith("ulp(1, 0.001)") and "strictly on cuda" in out["policy"]
    # Exact under the interpreter thanks to the explicit round-to-nearest-even.
    assert out["mismatches"] == 0


def test_report_json_round_trips(reports):
    import json

    data = json.loads(reports["returns_zeros"].to_json())
    assert data["verdict"] == "reject" and data["reasons"]
    assert data["per_shape"] and "near_miss" in data["per_shape"][0]
