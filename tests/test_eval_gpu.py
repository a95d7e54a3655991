"""The harness on a CUDA GPU: strict bitwise judging, allocator poisoning, side streams, CUDA-graph
timing, measured ceilings and the floor check. Skipped without CUDA (run on the H200)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autoopt.eval.shapes import gpu_shapes
from autoopt.eval.verify import prepare_all, run_trials, verify_variant
from model.ops import contract

pytestmark = pytest.mark.gpu
CORPUS = Path(__file__).resolve().parent / "adversarial"
TOKENS = (1, 17, 128)


def _verify(stem: str, op: str = "swiglu", **kw):
    return verify_variant(op, CORPUS / f"{stem}.py", device="cuda", seeds=(0, 1),
                          shapes=gpu_shapes(op, TOKENS), **kw)


@pytest.mark.parametrize("stem", ["honest_torch_swiglu", "honest_triton_swiglu"])
def test_honest_swiglu_is_bitwise_on_cuda(stem):
    rep = _verify(stem)
    assert rep.verdict == "pass", rep.reasons
    out = rep.checks["numerics"]["outputs"][0]
    assert out["policy"].startswith("bitwise") and out["mismatches"] == 0
    assert rep.checks["floor"]["passed"] and rep.env["gpu"]


@pytest.mark.parametrize("stem,op,needle", [
    ("stale_allocator", "swiglu", "not written (NaN poison survived)"),
    ("partial_write", "logit_softcap", "not written (NaN poison survived)"),
    ("pointer_cache", "attn_output_gate", "caches outputs by data pointer"),
    ("nondeterministic", "swiglu", "nondeterministic: two runs differ"),
    ("near_miss_two_step", "swiglu", "closer to near miss 'bf16_two_step'"),
    ("returns_input", "swiglu", "output 0 aliases input 0"),
])
def test_cheats_rejected_on_cuda(stem, op, needle):
    rep = _verify(stem, op)
    assert rep.verdict == "reject"
    assert any(needle in r for r in rep.reasons), rep.reasons


def test_side_stream_work_is_caught_at_runtime():
    # Bypasses the static screen (which refuses streams outright) to test the runtime guard.
    c = contract("swiglu")

    def side(gate, up, config=None):
        out = torch.empty_like(gate)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            torch.cuda._sleep(50_000_000)  # tens of ms: the caller's read comes first
            out.copy_(c.reference(gate, up))
        return out

    prepared = prepare_all(c, gpu_shapes("swiglu", (17,)), (0,), "cuda")
    reasons, _, _ = run_trials(c, side, prepared, {"device": "cuda"})
    assert any("side-stream work" in r for r in reasons), reasons


def test_cuda_graph_timing_and_ceilings(tmp_path, monkeypatch):
    from autoopt.eval.timing import measure_ceilings, time_callable

    monkeypatch.setenv("AUTOOPT_CACHE", str(tmp_path))
    x = torch.randn(8, 2560, device="cuda", dtype=torch.bfloat16)
    t = time_callable(lambda a: a * 2, [(x.clone(),) for _ in range(64)], device="cuda",
                      warmup=3, iters=20)
    assert t.method == "cuda-graph" and t.meaningful and t.calls_per_sample >= 64
    assert 0 < t.median_us < 100
    c = measure_ceilings("cuda")
    assert c.meaningful and c.copy_bytes_s > 1e12 and c.bf16_flops_s > 1e14
    assert list((tmp_path / "ceilings").glob("*.json"))
    assert measure_ceilings(torch.device("cuda")) == c  # cached per GPU name


def test_bench_rows_on_cuda_with_compile():
    from autoopt.eval.timing import bench_op

    rows = bench_op("swiglu", CORPUS / "honest_triton_swiglu.py", gpu_shapes("swiglu", (1, 128)),
                    "cuda", warmup=5, iters=20)
    for r in rows:
        assert r.meaningful and r.floor_ok and r.gpu and r.method == "cuda-graph"
        assert r.compile_us is not None, r.notes
        assert 0 < r.pct_of_floor <= 100 / 0.9


def test_a_candidate_faster_than_the_floor_is_void():
    from autoopt.eval.timing import bench_op

    shape = gpu_shapes("attn_output_gate", (16384,))
    (row,) = bench_op("attn_output_gate", CORPUS / "pointer_cache.py", shape, "cuda",
                      warmup=3, iters=10, compile=False)
    assert row.floor_ok is False
    assert any("faster than the floor" in n for n in row.notes)
