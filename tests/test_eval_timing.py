"""The timing harness on CPU (runs, but labelled not meaningful), floors, and bench_op rows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autoopt.eval.timing import (
    Ceilings,
    bench_op,
    floor_us,
    measure_ceilings,
    rotating_sets,
    sets_needed,
    time_callable,
)
from model.ops import contract

CORPUS = Path(__file__).resolve().parent / "adversarial"


def test_sets_needed_spans_twice_the_l2():
    l2 = 50 << 20  # H200
    assert sets_needed(10 << 20, l2) == 10
    assert sets_needed(200 << 20, l2) == 1
    assert sets_needed(1000, l2, max_sets=4096) == 4096  # capped: decode-sized inputs
    assert sets_needed(0, l2) == 1


def test_rotating_sets_are_distinct_buffers():
    sets = rotating_sets(lambda k: (torch.full((3,), float(k)), 7), 5, distinct=2)
    assert len(sets) == 5 and all(s[1] == 7 for s in sets)
    ptrs = {s[0].data_ptr() for s in sets}
    assert len(ptrs) == 5
    assert torch.equal(sets[4][0], sets[0][0])  # clones of the distinct ones


def test_time_callable_on_cpu_is_labelled_not_meaningful():
    calls = []

    def make(n):
        return [(torch.randn(17, 33),) for _ in range(n)]

    t = time_callable(lambda x: calls.append(1) or x * 2, make, device="cpu", warmup=2, iters=9)
    assert t.method == "cpu-perf-counter" and t.meaningful is False
    assert len(t.samples) == 9 and t.median_us > 0 and t.iqr_us >= 0
    assert 1 <= t.n_sets <= 4
    assert len(calls) >= 9


def test_measure_ceilings_on_cpu():
    c = measure_ceilings("cpu")
    assert c.meaningful is False and c.gpu == "cpu"
    assert c.copy_bytes_s > 0 and c.bf16_flops_s > 0 and c.fp32_flops_s > 0


def test_floor_is_bytes_over_bandwidth_or_flops_over_rate():
    c = contract("swiglu")
    shape = {"T": 8, "I": 2560}
    ceil = Ceilings(copy_bytes_s=4e12, bf16_flops_s=8e14, fp32_flops_s=5e13, gpu="test")
    assert floor_us(c, shape, ceil) == pytest.approx(c.cost(shape).bytes / 4e12 * 1e6)
    router = contract("router")
    rshape = {"T": 4096, "H": 5120, "E": 256}
    flops_floor = router.cost(rshape).flops / 5e13 * 1e6  # FP32 GEMM: the FP32 rate applies
    assert floor_us(router, rshape, ceil) == pytest.approx(
        max(flops_floor, router.cost(rshape).bytes / 4e12 * 1e6))


def test_bench_op_rows_on_cpu():
    shapes = [{"T": 1, "I": 64}, {"T": 17, "I": 64}]
    rows = bench_op("swiglu", CORPUS / "honest_torch_swiglu.py", shapes, "cpu", warmup=1,
                    iters=5, compile=False)
    assert [r.shape for r in rows] == shapes
    for r in rows:
        assert r.impl == "honest_torch_swiglu" and r.op == "swiglu"
        assert r.meaningful is False and r.floor_ok is True and r.gpu is None
        assert r.median_us > 0 and r.reference_us > 0 and r.compile_us is None
        assert r.x_reference == pytest.approx(r.reference_us / r.median_us)
        assert r.torch == torch.__version__ and r.triton
        assert any("--no-compile" in n for n in r.notes)


def test_bench_op_times_torch_compile_in_the_same_run():
    # One tiny shape: Inductor's CPU compile takes most of this test's time.
    rows = bench_op("swiglu", None, [{"T": 3, "I": 16}], "cpu", warmup=2, iters=5, compile=True)
    (row,) = rows
    assert row.impl == "reference" and row.x_reference == pytest.approx(1.0)
    compiled = row.compile_us is not None
    assert compiled or any("torch.compile failed" in n for n in row.notes)


def test_bench_op_refuses_a_screened_variant():
    with pytest.raises(ValueError, match="static screen: imports subprocess"):
        bench_op("swiglu", CORPUS / "subprocess_use.py", [{"T": 1, "I": 8}], "cpu")
