"""Kernel time -> ops: the attributed table the optimize loop ranks ops by.

Every profiler backend reduces a step to `KernelRecord`s, each labelled with the innermost named
range (op or model region) it was launched in, and to the number of times each range was
entered. `attribute` sums them per op and puts each op next to its floor: the op contract's
cost at the step's shapes (the calls recorded from the step, inventory.py) over the ceilings
(measured on this GPU, or the target's datasheet values); a `moe_experts` floor counts only the
experts the step's routing hit. The step's time on no kernel is split into named lines (idle
inside the CUDA graph, time outside it; or, for an eager step, launch overhead / idle).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from model.ops import OP_NAMES
from model.ops._contract import fp32_gemm_flops_s

from ..targets import REGIONS, OpCall

OTHER = "other"  # kernels launched outside every named range
IDLE = "launch overhead / idle"  # eager step wall time on no kernel
GRAPH_IDLE = "idle inside the graph"  # device gaps between a graph replay's kernels
OUTSIDE = "outside the graph (host, copies, sampling)"  # the served step's rest
LINES = (IDLE, GRAPH_IDLE, OUTSIDE)  # rows that are time on no kernel
KNOWN_RANGES: tuple[str, ...] = tuple(OP_NAMES) + REGIONS
# The router is an FP32 GEMM: its floor uses `fp32_gemm_flops_s` (FP32 FMAs or exact three-term
# BF16 products, whichever is faster); every other op uses the BF16 rate, the same rule as
# autoopt.eval.timing.floor_us (elementwise ops are bound by bytes either way).
FP32_OPS = {"router"}
SCHEMA = "autoopt.profile/2"


@dataclass(frozen=True)
class KernelRecord:
    name: str
    op: str  # innermost known range, or OTHER
    duration_us: float
    dram_bytes: int | None = None  # measured (Nsight Compute) or None
    kind: str = "kernel"  # kernel | memcpy | memset | cpu (a top-level aten op on the CPU)
    start_us: float | None = None  # device timestamp (torch.profiler traces)
    in_graph: bool = False  # launched by a CUDA-graph replay


def innermost(stack: Iterable[str], known: Sequence[str] = KNOWN_RANGES) -> str:
    """The innermost known name of a range stack listed outermost first."""
    hit = OTHER
    for name in stack:
        if name in known:
            hit = name
    return hit


@dataclass(frozen=True)
class Rates:
    """Ceilings a floor is computed on: measured on the local GPU, or datasheet values."""

    bandwidth_bytes_s: float
    bf16_flops_s: float
    fp32_flops_s: float
    source: str  # "measured on <gpu>" | "datasheet (<target>)"
    meaningful: bool = True

    @property
    def fp32_gemm_flops_s(self) -> float:
        return fp32_gemm_flops_s(self.bf16_flops_s, self.fp32_flops_s)

    def floor_s(self, name: str, cost) -> float:
        rate = self.fp32_gemm_flops_s if name in FP32_OPS else self.bf16_flops_s
        return cost.floor_s(self.bandwidth_bytes_s, rate)


@dataclass(frozen=True)
class OpRow:
    op: str
    calls: int
    kernels: int
    time_us: float
    share: float  # percent of the step (rows sum to 100)
    bytes: int | None = None
    bytes_source: str | None = None  # "ncu" (measured DRAM) | "cost model"
    gbps: float | None = None
    floor_us: float | None = None
    gap_us: float | None = None


@dataclass(frozen=True)
class Profile:
    """One attributed step: rows per op (plus `other` and the idle line), totals, metadata."""

    target: str
    phase: str
    batch: int
    context: int
    layers: int
    kernels: str
    backend: str  # "ncu" | "torch"
    backend_note: str
    gpu: str
    proxy: str | None  # "proxy for <target> measured on <gpu>", or None
    rows: tuple[OpRow, ...]
    step_us: float  # wall time of the served step (median engine.step())
    step_source: str
    kernel_us: float
    floor_us: float  # the step's floor: touched weights + KV over the ceilings (floor.py)
    rates: Rates
    graph_step_us: float | None = None
    attribution_note: str = ""
    notes: tuple[str, ...] = ()
    checks: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)  # op -> implementation that ran
    versions: dict[str, str] = field(default_factory=dict)
    created: str = ""
    floor: dict[str, Any] = field(default_factory=dict)  # floor.StepFloor.to_dict()
    attention_backend: str = ""

    def row(self, op: str) -> OpRow:
        for r in self.rows:
            if r.op == op:
                return r
        raise KeyError(f"no row {op!r} in the profile; rows: {[r.op for r in self.rows]}")

    def ops(self) -> list[OpRow]:
        """Rows of named ops and regions (not `other` or the idle lines), by time."""
        return [r for r in self.rows if r.op != OTHER and r.op not in LINES]

    def ranked(self) -> list[OpRow]:
        """Op-contract rows by gap to the floor, largest first: what the optimizer works on."""
        rows = [r for r in self.ops() if r.op in OP_NAMES]
        return sorted(rows, key=lambda r: -(r.gap_us if r.gap_us is not None else r.time_us))

    # ---- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["schema"] = SCHEMA
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Profile:
        if data.get("schema") != SCHEMA:
            raise ValueError(f"not an autoopt profile (schema {data.get('schema')!r}, expected "
                             f"{SCHEMA!r}); write one with `autoopt profile`")
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in data.items() if k in names}
        kw["rows"] = tuple(OpRow(**r) for r in data["rows"])
        kw["rates"] = Rates(**data["rates"])
        kw["notes"] = tuple(data.get("notes", ()))
        return cls(**kw)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read profile {path}: {e}") from None


def call_floor_us(c: OpCall, rates: Rates) -> float:
    """Floor of `c.count` calls; moe_experts reads only the experts its routing hit."""
    if c.name == "moe_experts" and len(c.touched) == c.count:
        from .floor import moe_call_floor_bytes

        rate = rates.bf16_flops_s
        return 1e6 * max(moe_call_floor_bytes(c) / rates.bandwidth_bytes_s,
                         c.cost.flops * c.count / rate)
    return rates.floor_s(c.name, c.cost) * c.count * 1e6


def attribute(records: Sequence[KernelRecord], calls: dict[str, int], expected: Sequence[OpCall],
              rates: Rates, step_us: float, lines: dict[str, float] | None = None
              ) -> tuple[tuple[OpRow, ...], float, float]:
    """Rows (by time, then `other`, then the no-kernel lines), total kernel time and total
    floor in µs. `lines` names the step's time on no kernel (default: step - kernels, idle)."""
    time_us: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    dram: dict[str, int] = defaultdict(int)
    measured = bool(records) and all(r.dram_bytes is not None for r in records)
    for r in records:
        time_us[r.op] += r.duration_us
        count[r.op] += 1
        dram[r.op] += r.dram_bytes or 0
    model_bytes: dict[str, int] = defaultdict(int)
    floor: dict[str, float] = defaultdict(float)
    want_calls: dict[str, int] = defaultdict(int)
    for c in expected:
        model_bytes[c.name] += c.cost.bytes * c.count
        floor[c.name] += call_floor_us(c, rates)
        want_calls[c.name] += c.count
    kernel_us = sum(time_us.values())
    if lines is None:
        lines = {IDLE: max(0.0, step_us - kernel_us)}
    total = kernel_us + sum(lines.values())
    names = set(time_us) | set(want_calls) | {n for n in calls if n in KNOWN_RANGES}
    rows = []
    for name in sorted(names - {OTHER}, key=lambda n: -time_us.get(n, 0.0)):
        t = time_us.get(name, 0.0)
        b = dram[name] if measured else model_bytes.get(name)
        source = "ncu" if measured else ("cost model" if name in model_bytes else None)
        fl = floor.get(name) if name in floor else None
        rows.append(OpRow(
            op=name, calls=calls.get(name, want_calls.get(name, 0)), kernels=count.get(name, 0),
            time_us=t, share=100.0 * t / total if total else 0.0, bytes=b, bytes_source=source,
            gbps=b / t / 1e3 if b and t else None, floor_us=fl,
            gap_us=t - fl if fl is not None else None))
    if time_us.get(OTHER):
        t = time_us[OTHER]
        rows.append(OpRow(OTHER, 0, count[OTHER], t, 100.0 * t / total,
                          dram[OTHER] if measured else None, "ncu" if measured else None))
    for name, t in lines.items():
        rows.append(OpRow(name, 0, 0, t, 100.0 * t / total if total else 0.0))
    return tuple(rows), kernel_us, sum(floor.values())


def align_by_order(ncu: Sequence[KernelRecord], labelled: Sequence[KernelRecord]
                   ) -> list[KernelRecord] | None:
    """Label Nsight kernels by launch order from another trace of the same step, if they match.

    Used when the report carries no NVTX stacks: the same seed gives the same weights, routing
    and so the same kernel sequence in both processes.
    """
    ref = [r for r in labelled if r.kind == "kernel"]
    if len(ref) != len(ncu):
        return None
    return [KernelRecord(k.name, r.op, k.duration_us, k.dram_bytes, k.kind)
            for k, r in zip(ncu, ref)]
