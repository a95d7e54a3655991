"""Kernel time inside a CUDA-graph replay, attributed to ops (autoopt/profiler/graph_trace.py).

The fixture (tests/data/graph_replay_trace.json) holds the two torch.profiler passes of one
served decode step of a 2-layer rank, in the chrome-trace schema torch exports: the eager pass of
the graph's static forward inside op ranges, and the replay, whose kernels carry no range but
share the `cudaGraphLaunch` correlation id. Under capture one GEMM picked another cuBLAS kernel.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autoopt.profiler.attribution import (
    GRAPH_IDLE,
    OTHER,
    OUTSIDE,
    KernelRecord,
    Rates,
    attribute,
)
from autoopt.profiler.graph_trace import align, gaps
from autoopt.profiler.torch_trace import parse_chrome_trace
from autoopt.targets import OpCall
from model.ops import Cost

DATA = json.loads((Path(__file__).parent / "data" / "graph_replay_trace.json").read_text())
PER_LAYER = {"qkv_gate_proj": 1, "paged_attention": 3, "attn_output_gate": 1, "o_proj": 1,
             "norm_residual_norm": 2, "router": 2, "moe_experts": 3}


@pytest.fixture(scope="module")
def traces():
    return (parse_chrome_trace(DATA["labelled"]["traceEvents"]),
            parse_chrome_trace(DATA["replay"]["traceEvents"]))


def test_the_replay_has_no_ranges_and_its_kernels_are_marked_in_graph(traces):
    labelled, replay = traces
    assert all(r.op == OTHER for r in replay.records)  # ranges are not re-emitted in a graph
    assert sum(r.in_graph for r in replay.records) == 30
    assert not any(r.in_graph for r in labelled.records)
    assert labelled.calls["norm_residual_norm"] == 4 and labelled.calls["rmsnorm"] == 1
    # The eager pass labels every kernel with its innermost range.
    counts = {}
    for r in labelled.records:
        counts[r.op] = counts.get(r.op, 0) + 1
    for op, n in PER_LAYER.items():
        assert counts[op] == 2 * n, op


def test_alignment_labels_replayed_kernels_and_leaves_the_unmatched_one_other(traces):
    labelled, replay = traces
    al = align(labelled.records, replay.records)
    assert al.replay_kernels == len(replay.records) == 32  # memcpy + 30 in graph + argmax
    assert al.matched == 31 and al.fraction == pytest.approx(31 / 32)
    by_op: dict[str, list[KernelRecord]] = {}
    for r in al.records:
        by_op.setdefault(r.op, []).append(r)
    for op, n in PER_LAYER.items():
        # The capture's other cuBLAS kernel (first o_proj) stays unlabelled.
        assert len(by_op[op]) == 2 * n - (op == "o_proj"), op
        assert all(r.duration_us == 5.0 for r in by_op[op])  # the replay's times, not eager's
    other = [r.name for r in by_op[OTHER]]
    assert any("splitk" in n for n in other)
    assert any("Memcpy" in n for n in other) and any("ArgMax" in n for n in other)


def test_idle_inside_the_graph_and_time_outside_it(traces):
    _, replay = traces
    al = align(parse_chrome_trace(DATA["labelled"]["traceEvents"]).records, replay.records)
    g = gaps(al.records)
    # 30 kernels of 5 us, 1 us apart: span 29 * 6 + 5 = 179 us, 150 us busy.
    assert g.graph_span_us == pytest.approx(179.0)
    assert g.graph_kernel_us == pytest.approx(150.0)
    assert g.graph_idle_us == pytest.approx(29.0)
    assert g.outside_kernel_us == pytest.approx(4.0)  # the input copy and the sampler's argmax
    lines = g.lines(step_us=900.0)
    assert lines == {GRAPH_IDLE: pytest.approx(29.0), OUTSIDE: pytest.approx(900 - 154 - 29)}
    # Never negative when the host clock says less than the device did.
    assert g.lines(step_us=100.0)[OUTSIDE] == 0.0


def test_attribution_rows_sum_to_the_served_step(traces):
    labelled, replay = traces
    al = align(labelled.records, replay.records)
    g = gaps(al.records)
    expected = [OpCall("moe_experts", {"T": 1, "H": 8, "E": 4, "I": 2, "k": 2}, 2,
                       Cost(bytes=1000, flops=10), touched=(2, 1))]
    rates = Rates(1e9, 1e12, 1e12, "test")
    calls = {c.name: c.count for c in expected}  # the recorded step's calls
    rows, kernel_us, _ = attribute(al.records, calls, expected, rates, 900.0, g.lines(900.0))
    names = [r.op for r in rows]
    assert names[-2:] == [GRAPH_IDLE, OUTSIDE] and OTHER in names
    assert sum(r.time_us for r in rows) == pytest.approx(900.0)
    assert abs(sum(r.share for r in rows) - 100.0) < 1e-6
    moe = next(r for r in rows if r.op == "moe_experts")
    assert moe.time_us == 30.0 and moe.kernels == 6 and moe.calls == 2
    # Its floor counts the experts its routing hit (2 and 1 of 4), not min(E, T*k) = 2 each.
    from model.ops import CONTRACTS

    cost = CONTRACTS["moe_experts"].cost
    want = sum(cost({"T": 1, "H": 8, "E": 4, "I": 2, "k": 2, "touched": t}).bytes
               for t in (2, 1)) / 1e9 * 1e6
    assert want == pytest.approx((2 * (3 * 3 * 2 * 8 + 2 * 2 * 8) + 2 * 12 * 2) / 1e3)
    assert moe.floor_us == pytest.approx(want)
    assert kernel_us == pytest.approx(154.0)
