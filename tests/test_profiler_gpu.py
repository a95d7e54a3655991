"""The served-step profiler and `bench model` on a real GPU (the GPU machine; skipped on CPU).

A 6-layer proxy of h200-tp8-decode (3 dense + 3 MoE layers, sliding and full attention: every
layer kind) on whatever CUDA GPU is present, at a short context so it runs in seconds.
"""

from __future__ import annotations

import pytest

from autoopt.bench_model import BenchModelArgs, run_bench
from autoopt.profiler import profile_step
from autoopt.profiler.attribution import GRAPH_IDLE, IDLE, OTHER, OUTSIDE
from autoopt.profiler.nsight import find_ncu
from autoopt.targets import load_target

pytestmark = pytest.mark.gpu
# The ops whose kernels one TP8 rank's decode step launches on a GPU with the locked registry.
# The output gate runs inside gated_o_proj (the reference composes attn_output_gate's variant
# with the library GEMM in its own range) and the attention backend's range holds only the
# attention op, so neither attn_output_gate nor paged_attention has kernels of its own.
OPS = {"rmsnorm", "allreduce_norm_residual_norm", "qkv_gate_proj", "qk_norm_rope",
       "qk_norm_ssmax", "attention", "gated_o_proj", "router", "moe_experts", "swiglu",
       "logit_softcap"}


@pytest.mark.parametrize("batch", [1, 8])
def test_graph_replay_is_attributed_to_ops(batch):
    # The locked set: the reference MoE syncs with the host, so a reference step is not captured.
    p = profile_step(load_target("h200-tp8-decode"), batch, layers=6, proxy=True,
                     context=2048, repeats=5, kernels="tuned")
    assert p.graph_step_us and p.checks["graph_bucket"] == batch
    assert p.checks["aligned_fraction"] > 0.9, p.checks
    assert OPS <= {r.op for r in p.rows if r.kernels > 0}
    assert {GRAPH_IDLE, OUTSIDE} <= {r.op for r in p.rows} and IDLE not in {r.op for r in p.rows}
    assert abs(sum(r.share for r in p.rows) - 100) <= 0.5
    other = sum(r.time_us for r in p.rows if r.op == OTHER)
    assert other < 0.1 * p.kernel_us
    assert p.floor["routing"] == "recorded" and p.step_us > p.floor_us > 0


def test_eager_profile_on_request():
    p = profile_step(load_target("h200-tp8-decode"), 8, layers=6, proxy=True, context=2048,
                     repeats=3, eager=True)
    assert p.graph_step_us is None and p.row(IDLE).time_us >= 0
    assert OPS <= {r.op for r in p.rows if r.kernels > 0}


@pytest.mark.skipif(find_ncu() is None, reason="needs Nsight Compute (ncu)")
def test_nsight_samples_only_the_top_ops():
    p = profile_step(load_target("h200-tp8-decode"), 8, layers=6, proxy=True, context=2048,
                     repeats=3, ncu_sample=16)
    sample = p.checks["ncu_sample"]
    assert "error" not in sample, sample
    assert 0 < len(sample["kernels"]) <= 16
    assert {k["op"] for k in sample["kernels"]} <= set(sample["ops"])
    assert all(k["dram_bytes"] is not None for k in sample["kernels"])


def test_bench_model_reference_vs_tuned():
    # reference-graphs: the reference ops with the MoE's library stand-in, which (unlike the
    # reference MoE, which syncs with the host) a CUDA graph can capture.
    res = run_bench(BenchModelArgs("h200-tp8-decode", batches=(1, 8), contexts=(2048,),
                                   layers=6, kernels=("reference-graphs", "tuned"), iters=5,
                                   proxy=True))
    assert res.meaningful and res.gpu != "cpu"
    for b in (1, 8):
        ref, tuned = res.row(2048, b, "reference-graphs"), res.row(2048, b, "tuned")
        assert ref.ran and tuned.ran and ref.graph_bucket == b and tuned.graph_bucket == b
        assert ref.x_floor > 1 and ref.kernels_per_step > 6 * 10
        assert sum(tuned.kernels_by_op.values()) == tuned.kernels_per_step
        assert tuned.parity["top1_agree"] and tuned.parity["finite"]
        assert tuned.speedup["reference-graphs"] == pytest.approx(ref.median_ms / tuned.median_ms)


@pytest.mark.slow
def test_bench_model_compile_set_keeps_the_reference_function():
    # Inductor with emulate_precision_casts compiles the same ops (each one judged against the
    # reference as the compile peer), captured in the same graphs. Its FP32 reductions sum in
    # another order, and with random weights one ulp anywhere can flip a routing choice and the
    # top-1 token (benchmarks/parity_sensitivity.py): the whole model's logits are compared for
    # being finite and reported, not held to the reference's top-1.
    res = run_bench(BenchModelArgs("h200-tp8-decode", batches=(1, 8), contexts=(2048,),
                                   layers=4, kernels=("reference", "compile"), iters=5,
                                   proxy=True))
    for b in (1, 8):
        c = res.row(2048, b, "compile")
        assert c.ran and c.graph_bucket == b
        assert c.parity["finite"] and c.parity["max_abs_diff"] < float("inf"), c.parity
        assert c.kernels_per_step and c.median_ms > 0
    assert any("not compiled" in n for n in res.notes)
