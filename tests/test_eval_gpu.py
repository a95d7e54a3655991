"""The judge on a CUDA GPU: strict bitwise judging at the target's widths, data-like poison, side
streams, racecheck, CUDA-graph timing checked against the judge's clock, measured ceilings and the
floor. Skipped without CUDA (run on the H200: `python -m pytest -q -m gpu tests/test_eval_gpu.py`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autoopt.eval.plan import Budget
from autoopt.eval.verify import verify_variant

pytestmark = pytest.mark.gpu
CORPUS = Path(__file__).resolve().parent / "adversarial"
TARGET = "h200-tp8-decode"
BUDGET = Budget(seeds=2)


def _verify(stem: str, op: str = "swiglu", **kw):
    return verify_variant(op, CORPUS / f"{stem}.py", device="cuda", target=TARGET,
                          budget=BUDGET, **kw)


@pytest.mark.parametrize("stem", ["honest_torch_swiglu", "honest_triton_swiglu"])
def test_honest_swiglu_is_bitwise_on_cuda(stem):
    rep = _verify(stem)
    assert rep.verdict == "pass", rep.reasons
    out = rep.checks["numerics"]["outputs"][0]
    assert out["policy"].startswith("bitwise") and out["mismatches"] == 0
    assert rep.checks["floor"]["passed"] and rep.env["gpu"]
    assert {s["I"] for s in rep.checks["plan"]["buckets"]} == {2560, 320}  # TP8 dense, experts
    want = "passed" if stem.endswith("triton_swiglu") else "not needed (no Triton or CuTe kernel)"
    assert rep.checks["races"]["status"] == want, rep.checks["races"]


@pytest.mark.parametrize("stem,op,needle", [
    ("stale_allocator", "swiglu", "not written (poison survived)"),
    ("partial_write", "logit_softcap", "not written (poison survived)"),
    ("pointer_cache", "attn_output_gate", "caches outputs by data pointer"),
    ("nondeterministic", "swiglu", "nondeterministic: two runs differ"),
    ("near_miss_two_step", "swiglu", "closer to near miss 'bf16_two_step'"),
    ("returns_input", "swiglu", "output 0 aliases input 0"),
    ("content_cache_torch", "attn_output_gate", "caches outputs by content"),
    ("reused_buffer_torch", "swiglu", "outputs changed after later calls"),
])
def test_cheats_rejected_on_cuda(stem, op, needle):
    rep = _verify(stem, op)
    assert rep.verdict == "reject"
    assert any(needle in r for r in rep.reasons), rep.reasons


@pytest.mark.parametrize("stem", ["race_write_write_triton", "race_overlap_tiles_triton"])
def test_cross_program_races_rejected_on_cuda(stem):
    rep = _verify(stem)
    assert rep.verdict == "reject", rep.checks.get("races")


def test_side_stream_work_is_caught_at_runtime():
    # An in-process candidate (the static screen refuses streams outright) whose work lands on
    # another stream after the call returns: the outputs read back later differ.
    from tests.test_eval_trials import session

    def side(gate, up):
        out = torch.empty_like(gate)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            torch.cuda._sleep(50_000_000)  # tens of ms: the caller's read comes first
            out.copy_((torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype))
        return out

    try:
        reasons = session("swiglu", side, BUDGET, device="cuda")[0]
    finally:
        # Its side streams still sleep and then write into memory the judge has freed: let
        # them finish before the next test allocates (and captures graphs) in this process.
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    assert reasons, "side-stream work went unnoticed"


def test_a_failed_capture_leaves_the_cuda_generator_usable():
    # An unjoined side stream fails cudaStreamEndCapture, which torch reports before it takes the
    # default generator out of capture mode: random ops outside graphs would fail from then on.
    from autoopt.eval.timing import time_callable

    def unjoined(a):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            a.mul_(1)

    torch.cuda.manual_seed(1234)
    x = torch.randn(16, device="cuda")
    t = time_callable(unjoined, [(x.clone(),)], device="cuda", warmup=1, iters=2)
    assert t.method == "cuda-events" and "capture failed" in t.notes[0], t
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    assert gen.initial_seed() == 1234
    torch.randn(8, device="cuda")  # raised "Offset increment outside graph capture" before


def test_cuda_graph_timing_and_ceilings(tmp_path, monkeypatch):
    from autoopt.eval.timing import measure_ceilings, time_callable

    monkeypatch.setenv("AUTOOPT_CACHE", str(tmp_path))
    x = torch.randn(8, 2560, device="cuda", dtype=torch.bfloat16)
    t = time_callable(lambda a: a * 2, [(x.clone(),) for _ in range(64)], device="cuda",
                      warmup=3, iters=20)
    assert t.method == "cuda-graph" and t.meaningful and t.calls_per_sample >= 64, t
    assert 0 < t.median_us < 100, t
    c = measure_ceilings("cuda")
    assert c.meaningful and c.copy_bytes_s > 1e12 and c.bf16_flops_s > 1e14, c
    assert list((tmp_path / "ceilings").glob("*.json")), sorted(tmp_path.rglob("*"))
    assert measure_ceilings(torch.device("cuda")) == c  # cached per GPU name


def test_bench_rows_on_cuda_with_compile():
    from autoopt.eval.shapes import gpu_shapes
    from autoopt.eval.timing import bench_op

    rows = bench_op("swiglu", CORPUS / "honest_triton_swiglu.py", gpu_shapes("swiglu", (1, 128)),
                    "cuda", warmup=5, iters=20)
    for r in rows:
        assert r.meaningful and r.floor_ok and r.valid and r.gpu
        assert r.method == "cuda-graph in the worker", r.notes
        assert r.compile_us is not None, r.notes
        assert 0 < r.pct_of_floor <= 100 / 0.8
        assert r.wall_us and 0.8 <= r.median_us / r.wall_us <= 1.25  # events agree with the wall


def test_a_cached_candidate_is_void_when_timed():
    # Returns cached tensors during graph capture (no kernels recorded): the timed outputs do not
    # follow the new content written before the replays, and the time is impossibly short.
    from autoopt.eval.shapes import gpu_shapes
    from autoopt.eval.timing import bench_op

    (row,) = bench_op("attn_output_gate", CORPUS / "pointer_cache.py",
                      gpu_shapes("attn_output_gate", (16384,)), "cuda", warmup=3, iters=10,
                      compile=False)
    assert row.floor_ok is False
    assert any("faster than the floor" in n or n.startswith("timing void") for n in row.notes)


def test_memcheck_sees_stores_past_the_output_and_passes_an_honest_kernel():
    # The cheat's outputs are all right; its extra stores land in the allocator's slack, where
    # only memcheck (with the caching allocator off in the worker) sees them.
    cheat = Path(__file__).resolve().parent / "data" / "oob_write_triton.py"
    rep = verify_variant("swiglu", cheat, device="cuda", target=TARGET, budget=BUDGET,
                         memcheck=True)
    assert rep.verdict == "reject" and rep.checks["memcheck"]["status"] == "errors found", (
        rep.checks.get("memcheck"), rep.reasons)
    assert any(r.startswith("memcheck: compute-sanitizer memcheck found") for r in rep.reasons), (
        rep.reasons)
    honest = _verify("honest_triton_swiglu", memcheck=True)
    assert honest.verdict == "pass", honest.reasons
    assert honest.checks["memcheck"]["status"] == "passed", honest.checks["memcheck"]


def test_a_config_per_bucket_reaches_each_call_on_cuda_and_the_judge_says_where_time_went(
        tmp_path):
    # The per-call config choice on the GPU path: the worker under racecheck included (the
    # candidate raises on any call given another bucket's config); inputs reach the arena
    # straight from the device.
    from autoopt.eval.run import PerBucket

    src = tmp_path / "tagged.py"
    src.write_text(
        "import torch.nn.functional as F\n\nDEFAULT_CONFIG = {'TAG': 0}\n\n\n"
        "def run(gate, up, config=None):\n"
        "    t = gate.shape[0]\n"
        "    want = 1 if t <= 2 else 8 if t <= 22 else 64\n"
        "    if config != {'TAG': want}:\n"
        "        raise ValueError(f'T={t} got {config}, wanted {want}')\n"
        "    return (F.silu(gate.float()) * up.float()).to(gate.dtype)\n")
    per = PerBucket.of("swiglu", {"T=1": {"TAG": 1}, "T=8": {"TAG": 8}, "T=64": {"TAG": 64}})
    rep = verify_variant("swiglu", src, device="cuda", target=TARGET, budget=BUDGET, config=per)
    assert rep.verdict == "pass", rep.reasons
    spent = rep.checks["judge_time_s"]
    assert spent["transfers"] > 0 and spent["calls"] > 0 and spent["reference"] > 0
