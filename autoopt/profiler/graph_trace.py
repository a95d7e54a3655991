"""Kernel time inside a CUDA-graph replay, attributed to ops.

NVTX and profiler ranges are host-side: a graph replay launches its kernels without them, so a
replay's trace carries kernel names and times but no ops. The served step is profiled twice:
1. a labelling pass: the same step with the decode graph's static-buffer forward run eagerly
   (what the graph captured: same code, same shapes, same kernels) inside op ranges, which
   gives the per-op kernel *sequence*;
2. the replay pass: the step as served (graph replay), which gives each kernel's *time*.
`align` matches the two kernel sequences by name (difflib's longest matching blocks, so a kernel
present in one pass only, e.g. a cuBLAS algorithm picked differently under capture, shifts
nothing) and labels each replayed kernel with its match's op; an unmatched kernel stays `other`,
and the matched fraction is reported. `gaps` splits the rest of the step's wall time into the
device's idle time inside the graph (between its kernels) and the time outside the graph (host
scheduling, input copies, sampling).
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass

from .attribution import GRAPH_IDLE, OTHER, OUTSIDE, KernelRecord


@dataclass(frozen=True)
class Alignment:
    records: list[KernelRecord]  # the replay's kernels, labelled
    matched: int  # replay kernels matched to a labelled kernel
    replay_kernels: int
    labelled_kernels: int

    @property
    def fraction(self) -> float:
        return self.matched / self.replay_kernels if self.replay_kernels else 0.0


def align(labelled: Sequence[KernelRecord], replay: Sequence[KernelRecord]) -> Alignment:
    """Label `replay`'s device records with the ops of the same kernels in `labelled`."""
    a = [r.name for r in labelled]
    b = [r.name for r in replay]
    labels = [OTHER] * len(b)
    matched = 0
    for block in difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks():
        for k in range(block.size):
            labels[block.b + k] = labelled[block.a + k].op
        matched += block.size
    out = [KernelRecord(r.name, labels[i] if r.op == OTHER else r.op, r.duration_us,
                        r.dram_bytes, r.kind, r.start_us, r.in_graph)
           for i, r in enumerate(replay)]
    return Alignment(out, matched, len(b), len(a))


@dataclass(frozen=True)
class Gaps:
    graph_span_us: float  # first kernel start to last kernel end inside the graph
    graph_kernel_us: float
    outside_kernel_us: float

    @property
    def graph_idle_us(self) -> float:
        return max(0.0, self.graph_span_us - self.graph_kernel_us)

    def lines(self, step_us: float) -> dict[str, float]:
        """Non-kernel lines of the step: idle inside the graph, and the rest (outside)."""
        kernel = self.graph_kernel_us + self.outside_kernel_us
        outside = max(0.0, step_us - kernel - self.graph_idle_us)
        return {GRAPH_IDLE: self.graph_idle_us, OUTSIDE: outside}


def gaps(records: Sequence[KernelRecord]) -> Gaps:
    graph = [r for r in records if r.in_graph and r.start_us is not None]
    busy = sum(r.duration_us for r in graph)
    if graph:
        span = max(r.start_us + r.duration_us for r in graph) - min(r.start_us for r in graph)
    else:
        span = 0.0
    outside = sum(r.duration_us for r in records if not r.in_graph)
    return Gaps(span, busy, outside)


__all__ = ["Alignment", "GRAPH_IDLE", "Gaps", "OUTSIDE", "align", "gaps"]


@dataclass(frozen=True)
class ServedTrace:
    """One served step traced twice: `labelled`, run eagerly inside the ops' ranges (the code
    the graph captured); `aligned`, the graph replay's kernels labelled from it (None where the
    engine captured no graph for this bucket)."""

    labelled: object  # torch_trace.Trace
    aligned: Alignment | None


def trace_served(served) -> ServedTrace:
    """The labelled eager pass and, where the step replays a CUDA graph, the replay aligned to
    it: what `autoopt profile` attributes and `bench model` counts kernels from."""
    from .torch_trace import trace_call

    with served.eager():
        labelled = trace_call(served.step, served.device, ranges=True)
    if served.bucket() is None:
        return ServedTrace(labelled, None)
    replay = trace_call(served.step, served.device, ranges=False)
    return ServedTrace(labelled, align([r for r in labelled.records if r.kind != "cpu"],
                                       replay.records))
