"""torch.profiler over one step, attributed through its range events.

Ranges: the model's op and region ranges, emitted as `record_function` ranges when profiling
(`model.ops.set_nvtx(True, record_function=True)`). On a GPU each kernel is attributed through
its launch (the runtime call with the same CUPTI correlation id) to the innermost range open on
the launching thread; kernel durations are CUPTI's. A kernel launched by a CUDA-graph replay
(`cudaGraphLaunch`) is marked `in_graph`: no range is open inside a graph, so its op comes from
aligning the replay with an eager pass of the same forward (graph_trace.py). On the CPU there are
no kernels: each top-level aten op inside the step stands for one, with its CPU time.
"""

from __future__ import annotations

import bisect
import json
import os
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .attribution import KNOWN_RANGES, OTHER, KernelRecord

STEP_RANGE = "autoopt_step"

_LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}
_DEVICE_CATS = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}


@dataclass(frozen=True)
class Trace:
    records: list[KernelRecord]
    calls: dict[str, int]  # range entries per name inside the step
    step_range_us: float  # the step's range on the host clock (profiled)
    device: str


class _Segments:
    """Non-overlapping [start, end) pieces of one thread's ranges, each owned by its innermost."""

    def __init__(self, ranges: list[tuple[float, float, str]]) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.names: list[str] = []
        stack: list[tuple[float, str]] = []
        cursor = 0.0
        for start, end, name in sorted(ranges, key=lambda r: (r[0], -r[1])):
            while stack and stack[-1][0] <= start:
                cursor = self._close(stack, cursor)
            if stack:
                self._emit(cursor, start, stack[-1][1])
            stack.append((end, name))
            cursor = start
        while stack:
            cursor = self._close(stack, cursor)

    def _close(self, stack: list[tuple[float, str]], cursor: float) -> float:
        end, name = stack.pop()
        self._emit(cursor, end, name)
        return max(cursor, end)

    def _emit(self, start: float, end: float, name: str) -> None:
        if end > start:
            self.starts.append(start)
            self.ends.append(end)
            self.names.append(name)

    def at(self, ts: float) -> str:
        i = bisect.bisect_right(self.starts, ts) - 1
        return self.names[i] if i >= 0 and ts < self.ends[i] else OTHER


def _top_level(ops: list[dict]) -> list[dict]:
    """CPU ops not nested in another CPU op of the same thread."""
    out, end = [], float("-inf")
    for e in sorted(ops, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= end:
            out.append(e)
            end = e["ts"] + e["dur"]
    return out


def parse_chrome_trace(events: list[dict[str, Any]], step: str = STEP_RANGE) -> Trace:
    """Attribute a torch.profiler chrome trace (its `traceEvents`) to the known ranges."""
    spans = [e for e in events if e.get("ph") == "X"]
    steps = [e for e in spans if e.get("cat") == "user_annotation" and e.get("name") == step]
    if not steps:
        raise ValueError(f"the trace has no {step!r} range: was the step run inside it?")
    lo, hi = steps[0]["ts"], steps[0]["ts"] + steps[0]["dur"]
    inside = [e for e in spans if lo <= e.get("ts", -1.0) <= hi]
    by_tid: dict[Any, list[tuple[float, float, str]]] = {}
    calls: Counter[str] = Counter()
    for e in inside:
        if e.get("cat") == "user_annotation" and e.get("name") in KNOWN_RANGES:
            by_tid.setdefault(e["tid"], []).append((e["ts"], e["ts"] + e["dur"], e["name"]))
            calls[e["name"]] += 1
    segments = {tid: _Segments(r) for tid, r in by_tid.items()}

    def label(tid, ts: float) -> str:
        seg = segments.get(tid)
        return seg.at(ts) if seg else OTHER

    launches = {e["args"]["correlation"]: e for e in inside
                if e.get("cat") in _LAUNCH_CATS and "correlation" in e.get("args", {})}
    device = [e for e in spans if e.get("cat") in _DEVICE_CATS]
    records = []
    for e in sorted(device, key=lambda e: e["ts"]):
        launch = launches.get(e.get("args", {}).get("correlation"))
        if launch is None:
            continue  # launched outside the step
        records.append(KernelRecord(
            e.get("name", "?"), label(launch["tid"], launch["ts"]), float(e["dur"]), None,
            _DEVICE_CATS[e["cat"]], start_us=float(e["ts"]),
            in_graph=str(launch.get("name", "")).startswith("cudaGraphLaunch")))
    if device:
        return Trace(records, dict(calls), float(steps[0]["dur"]), "cuda")
    cpu = [e for e in inside if e.get("cat") == "cpu_op" and e.get("tid") == steps[0]["tid"]]
    records = [KernelRecord(e["name"], label(e["tid"], e["ts"]), float(e["dur"]), None, "cpu")
               for e in _top_level(cpu)]
    return Trace(records, dict(calls), float(steps[0]["dur"]), "cpu")


def trace_call(run: Callable[[], object], device: torch.device, ranges: bool = True,
               keep: str | None = None) -> Trace:
    """Profile `run()` (one step) with torch.profiler and attribute it; op ranges on when
    `ranges`; `keep` names a file the raw chrome trace is copied to."""
    from model.ops import set_nvtx

    # Kineto prints a line per profiler start and stop on stderr (noise in every command that
    # profiles); a KINETO_LOG_LEVEL the user set is kept.
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize(device)
    set_nvtx(ranges, record_function=ranges)
    try:
        with torch.profiler.profile(activities=activities) as prof:
            with torch.profiler.record_function(STEP_RANGE):
                run()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
    finally:
        set_nvtx(False)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
        if keep:
            Path(keep).write_text(json.dumps({"traceEvents": events}))
    return parse_chrome_trace(events)
