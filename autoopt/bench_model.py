"""`autoopt bench model`: the served step, kernel set against kernel set, against its floor.

For a target it builds the rank model once (random weights filled on the device, or a
checkpoint's rank 0 with `--model`), then for each context and each kernel set builds the
serving engine (paged KV pre-filled to the context, CUDA graphs on a GPU, the chosen attention
backend) and for each batch size serves that many real sequences and times `engine.step()`:
median and IQR, tokens/s, the step's floor (weights its routing touched plus KV bytes, over the
bandwidth measured in this process; profiler/floor.py) and the step's multiple of it, kernels per
step and per layer (counted in a profiled replay), and every set's speedup over the first set.
The first step of each batch is an eager, recorded pass of the same forward: its op calls and
routing give the floor, its logits the parity of each set with the first set.

`compile` is the reference step with every op under torch.compile (profiler/kernel_sets.py).
On the CPU (cpu-tiny) everything runs and every time is labelled not meaningful.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .targets import Target, TargetError, load_target

SCHEMA = "autoopt.bench_model/1"
GPU_SETS = ("reference", "tuned", "compile")
CPU_SETS = ("reference", "tuned")
PREFILL_DEFAULT = (8, 2048)  # sequences x prompt tokens
MIN_SAMPLES = 5  # timed steps a row keeps however long they take (median and quartiles)


@dataclass(frozen=True)
class BenchModelArgs:
    target: str
    batches: tuple[int, ...] = ()  # default: the target's batch sizes
    contexts: tuple[int, ...] = ()  # default: the target's first context
    layers: int | None = None
    kernels: tuple[str, ...] = ()  # default: GPU_SETS on a GPU, CPU_SETS on the CPU
    attention_backend: str = "auto"
    phase: str | None = None  # default: the target's
    model: str | None = None
    registry: str | None = None
    iters: int | None = None  # timed steps per row (default 20 on a GPU, 2 on the CPU)
    row_s: float | None = None  # stop a row's timed steps after this long (keeping MIN_SAMPLES)
    warmup: int = 2
    seed: int = 0
    proxy: bool = False
    budget_s: float | None = None
    count_kernels: bool = True  # one profiled step per row
    first_fit: bool = False  # each batch at the first of `contexts` where it fits, only there

    def __post_init__(self) -> None:
        if self.phase not in (None, "decode", "prefill"):
            raise ValueError(f"--phase must be decode or prefill, got {self.phase!r}")
        if any(b < 1 for b in self.batches) or any(c < 2 for c in self.contexts):
            raise ValueError("--batch values must be >= 1 and --context values >= 2")
        if self.iters is not None and self.iters < 1:
            raise ValueError("--iters must be >= 1")
        if self.row_s is not None and self.row_s <= 0:
            raise ValueError("--row-s must be > 0")


@dataclass
class Row:
    """One (context, batch, kernel set): the step's time against its floor."""

    context: int
    batch: int
    kernels: str  # the set's label
    ran: bool = True
    why: str = ""
    median_ms: float | None = None
    iqr_ms: float | None = None
    samples_ms: list[float] = field(default_factory=list)
    tokens_per_s: float | None = None
    floor_ms: float | None = None
    x_floor: float | None = None
    kernels_per_step: int | None = None
    kernels_per_layer: float | None = None
    kernels_by_op: dict[str, int] = field(default_factory=dict)  # one step's, per op range
    attention_block_kernels: float | None = None  # per layer (ATTENTION_BLOCK's ops)
    graph_bucket: int | None = None
    speedup: dict[str, float] = field(default_factory=dict)  # first set's time / this set's
    parity: dict[str, Any] = field(default_factory=dict)


@dataclass
class BenchResult:
    target: str
    phase: str
    gpu: str
    meaningful: bool
    layers: int
    kernels: list[str]
    attention_backend: str
    rates: dict[str, Any]
    rows: list[Row]
    floors: dict[str, Any]  # "context/batch" -> StepFloor dict
    notes: list[str]
    stages: dict[str, float]  # seconds per stage
    versions: dict[str, str]
    created: str

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, **dataclasses.asdict(self)}

    def row(self, context: int, batch: int, kernels: str) -> Row:
        for r in self.rows:
            if (r.context, r.batch, r.kernels) == (context, batch, kernels):
                return r
        raise KeyError(f"no row for context {context}, batch {batch}, kernels {kernels}")


# ---- planning ------------------------------------------------------------------------------------
def resolve_target(args: BenchModelArgs) -> tuple[Target, tuple[int, ...], tuple[int, ...]]:
    """The target in the asked phase, and the batches and contexts to run."""
    t = load_target(args.target)
    phase = args.phase or t.phase
    if phase != t.phase:
        b, c = PREFILL_DEFAULT if phase == "prefill" else (t.batch_sizes, t.contexts)
        t = dataclasses.replace(t, phase=phase, batch_sizes=b if isinstance(b, tuple) else (b,),
                                contexts=c if isinstance(c, tuple) else (c,))
    return t, args.batches or t.batch_sizes, args.contexts or t.contexts[:1]


def fitting_batches(target: Target, batches: tuple[int, ...], context: int, layers: int,
                    free_bytes: int | None) -> tuple[list[int], list[str]]:
    """The batches whose KV cache and activations fit next to the model (all, on the CPU)."""
    if free_bytes is None:
        return list(batches), []
    from .profiler.rank import activation_bytes, kv_bytes

    keep, notes = [], []
    for b in sorted(batches):
        need = kv_bytes(target, b, context + 64, layers) + activation_bytes(target, b, context)
        if need < free_bytes:
            keep.append(b)
        else:
            notes.append(f"context {context}, batch {b}: not run, its KV cache and activations "
                         f"need {need / 1e9:.1f} GB and {free_bytes / 1e9:.1f} GB are free")
    return keep, notes


# ---- running -------------------------------------------------------------------------------------
class Clock:
    """Stage timings (printed as they finish) and the optional deadline."""

    def __init__(self, budget_s: float | None, say: Callable[[str], None]) -> None:
        self.start = time.monotonic()
        self.deadline = self.start + budget_s if budget_s else None
        self.stages: dict[str, float] = {}
        self.row_s: dict[tuple[int, int], float] = {}  # (context, batch) -> longest row so far
        self.say = say

    def over(self, need_s: float = 0.0) -> bool:
        """Past the deadline, or less than `need_s` before it."""
        return self.deadline is not None and time.monotonic() + need_s > self.deadline

    def stage(self, name: str, since: float) -> None:
        took = time.monotonic() - since
        self.stages[name] = self.stages.get(name, 0.0) + took
        self.say(f"[{time.monotonic() - self.start:6.1f} s] {name}: {took:.1f} s")


# The ops of one attention block (projection, Q/K norm with the cache write, attention, gate and
# output projection): their kernels per layer are the block's launch count.
ATTENTION_BLOCK = ("qkv_gate_proj", "qk_norm_rope", "qk_norm_ssmax", "paged_attention",
                   "attention", "attn_output_gate", "gated_o_proj")


def count_kernels(served) -> tuple[int, dict[str, int]]:
    """Kernels (CPU: top-level aten ops) one served step launches, in all and per op.

    The total is the step as served (a graph replay where the engine captured one). Per-op counts
    need op ranges, which a replay does not carry: the step is also run eagerly inside the ops'
    ranges (the code the graph captured) and the replay's kernels take the ops of their matches
    in that labelled pass (`profiler.graph_trace.align`), so the per-op counts sum to the total.
    A replay kernel with no match counts as `other`."""
    from .profiler.graph_trace import trace_served

    tr = trace_served(served)
    records = tr.aligned.records if tr.aligned is not None else tr.labelled.records
    counted = [r for r in records if r.kind in ("kernel", "cpu")]
    out: dict[str, int] = {}
    for r in counted:
        out[r.op] = out.get(r.op, 0) + 1
    return len(counted), dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


def attention_block_kernels(by_op: dict[str, int], layers: int) -> float | None:
    """Kernels one attention block launches (mean over the step's layers)."""
    if not by_op or layers < 1:
        return None
    return sum(by_op.get(op, 0) for op in ATTENTION_BLOCK) / layers


def _parity(ref: torch.Tensor | None, new: torch.Tensor | None) -> dict[str, Any]:
    if ref is None or new is None or ref.shape != new.shape:
        return {}
    a, b = ref.float(), new.float()
    return {"max_abs_diff": float((a - b).abs().max()),
            "top1_agree": bool((a.argmax(-1) == b.argmax(-1)).all()),
            "bitwise_equal_fraction": float((a == b).float().mean()),
            "finite": bool(torch.isfinite(b).all())}


def timed_steps(step: Callable[[], float], iters: int, row_s: float | None) -> list[float]:
    """`iters` step times in ms, or fewer when `row_s` seconds are spent first (never fewer
    than MIN_SAMPLES): an eager reference step at a large batch takes seconds, and twenty of
    them buy no more than eight."""
    end = time.monotonic() + row_s if row_s else None
    samples: list[float] = []
    for _ in range(iters):
        samples.append(step() * 1e3)
        if end is not None and len(samples) >= MIN_SAMPLES and time.monotonic() > end:
            break
    return samples


def bench_batch(served, target: Target, kset: str, batch: int, iters: int, warmup: int,
                layers: int, rates, ref_logits: torch.Tensor | None,
                count: bool = True, row_s: float | None = None) -> tuple[Row, Any, Any]:
    """One row: the recorded pass (floor, parity), kernel count, then the timed steps."""
    from .profiler.floor import step_floor
    from .profiler.inventory import record_step

    ctx = served.shape.context
    served.start(batch)
    served.ensure(iters + warmup + 4)  # + the recorded, counted and labelled steps
    calls, logits = record_step(served)
    floor = step_floor(calls, served.model, target.phase, batch, ctx, rates)
    for _ in range(warmup):
        served.step()
    n_kernels, by_op = count_kernels(served) if count else (None, {})
    samples = timed_steps(served.step, iters, row_s)
    med = statistics.median(samples)
    q = statistics.quantiles(samples, n=4) if len(samples) >= 4 else [med, med, med]
    tokens = batch * (ctx if target.phase == "prefill" else 1)
    row = Row(context=ctx, batch=batch, kernels=kset, median_ms=med, iqr_ms=q[2] - q[0],
              samples_ms=samples, tokens_per_s=tokens / (med / 1e3),
              floor_ms=floor.floor_us / 1e3, x_floor=med / (floor.floor_us / 1e3),
              kernels_per_step=n_kernels,
              kernels_per_layer=n_kernels / max(layers, 1) if n_kernels is not None else None,
              kernels_by_op=by_op, attention_block_kernels=attention_block_kernels(by_op, layers),
              graph_bucket=served.bucket(), parity=_parity(ref_logits, logits))
    return row, floor, logits


def run_bench(args: BenchModelArgs, say: Callable[[str], None] = print) -> BenchResult:
    """Run `autoopt bench model` in this process; `say` gets one line per finished stage."""
    from .profiler import local_rates, versions
    from .profiler.kernel_sets import parse_sets
    from .profiler.rank import build_rank_model, default_device, free_model, plan_layers

    target, batches, contexts = resolve_target(args)
    proxy = target.require_local_gpu(args.proxy)
    device = default_device(target)
    gpu = device.type == "cuda"
    sets = parse_sets(",".join(args.kernels), GPU_SETS if gpu else CPU_SETS)
    iters = args.iters or (20 if gpu else 2)
    clock = Clock(args.budget_s, say)
    notes = [proxy] if proxy else []
    t0 = time.monotonic()
    rates = local_rates(target, device, proxy)
    clock.stage("ceilings", t0)
    layers = args.layers
    if gpu and args.model is None:
        layers, why = plan_layers(target, min(batches), max(contexts),
                                  torch.cuda.mem_get_info(device)[0], args.layers)
        notes.append(why)
    t0 = time.monotonic()
    rank = build_rank_model(target, layers, device, args.seed, args.model)
    notes += rank.notes
    clock.stage("model build", t0)
    rows: list[Row] = []
    floors: dict[str, Any] = {}
    backend = ""
    try:
        pending = tuple(batches)
        for i, ctx in enumerate(contexts):
            todo = pending if args.first_fit else tuple(batches)
            if not todo:
                break
            free = torch.cuda.mem_get_info(device)[0] if gpu else None
            fit, why = fitting_batches(target, todo, ctx, rank.layers, free)
            notes += why
            unfit = tuple(b for b in todo if b not in fit)
            if args.first_fit and unfit and i + 1 < len(contexts):
                notes.append(f"context {ctx}: batch {', '.join(map(str, unfit))} run at "
                             f"context {contexts[i + 1]} (or the next one where they fit)")
            else:
                rows += [Row(ctx, b, s, ran=False, why="does not fit") for b in unfit
                         for s in sets]
            pending = unfit
            if not fit:
                continue
            refs: dict[int, torch.Tensor] = {}
            # Batch by batch, every kernel set at that batch before the next: a budget that
            # runs out still leaves side-by-side rows (an engine per set and batch; its KV
            # cache is filled at random, so building one costs little beside the timing).
            for b in fit:
                for name in sets:
                    got, backend = _bench_set(args, target, rank, name, ctx, [b], iters, rates,
                                              refs, floors, clock, notes, device)
                    rows += got
    finally:
        free_model(rank)
    _speedups(rows, [kernel_label(s) for s in sets])
    return BenchResult(
        target=target.name, phase=target.phase,
        gpu=torch.cuda.get_device_name(device) if gpu else "cpu", meaningful=rates.meaningful,
        layers=rank.layers, kernels=[kernel_label(s) for s in sets], attention_backend=backend,
        rates=dataclasses.asdict(rates), rows=rows, floors=floors, notes=notes,
        stages=clock.stages, versions=versions(),
        created=time.strftime("%Y-%m-%dT%H:%M:%S"))


def kernel_label(name: str) -> str:
    from .profiler.kernel_sets import BUILDERS

    return name if name in BUILDERS else f"lock:{Path(name).name}"


def _bench_set(args, target, rank, name, ctx, fit, iters, rates, refs, floors, clock, notes,
               device) -> tuple[list[Row], str]:
    from .profiler.kernel_sets import kernel_set
    from .profiler.served import ServedStep, ServeShape

    label = kernel_label(name)
    if clock.over():
        note = f"context {ctx}, {label}: not run, the budget was spent"
        notes += [note] if note not in notes else []
        return [Row(ctx, b, label, ran=False, why="budget spent") for b in fit], ""
    t0 = time.monotonic()
    kset = kernel_set(name, device, args.registry)
    rank.model.set_ops(kset.table)
    notes += [n for n in kset.notes if n not in notes]
    steps = (iters + args.warmup + 4) * 2
    served = ServedStep(rank.model, ServeShape(target.phase, max(fit), ctx, steps=steps),
                        cuda_graphs=device.type == "cuda",
                        attention_backend=args.attention_backend, seed=args.seed)
    notes += [m for m in (f"{label}: {n}" for n in served.notes) if m not in notes]
    clock.stage(f"context {ctx}, batch {max(fit)}, {label}: engine (graph capture)", t0)
    out = []
    try:
        for b in fit:
            # A row is started only if one like it (same batch, an earlier set) would end in time.
            if clock.over(clock.row_s.get((ctx, b), 0.0)):
                out.append(Row(ctx, b, label, ran=False, why="budget spent"))
                continue
            t0 = time.monotonic()
            row, floor, logits = bench_batch(served, target, label, b, iters, args.warmup,
                                             rank.layers, rates, refs.get(b),
                                             args.count_kernels, args.row_s)
            refs.setdefault(b, logits)
            floors.setdefault(f"{ctx}/{b}", floor.to_dict())
            out.append(row)
            clock.row_s[(ctx, b)] = max(clock.row_s.get((ctx, b), 0.0), time.monotonic() - t0)
            clock.stage(f"context {ctx}, batch {b}, {label}: {row.median_ms:.2f} ms/step", t0)
        backend = served.engine.runner.attention_backend
    finally:
        served.close()
    return out, backend


def _speedups(rows: list[Row], sets: list[str]) -> None:
    """Each row's speedup over every other set at the same context and batch."""
    by = {(r.context, r.batch, r.kernels): r for r in rows if r.ran}
    for r in by.values():
        for other in sets:
            o = by.get((r.context, r.batch, other))
            if o is not None and other != r.kernels:
                r.speedup[other] = o.median_ms / r.median_ms


def merge_results(a: BenchResult, b: BenchResult) -> BenchResult:
    """One table from two runs of the same target in one process (e.g. the compile set run
    last, so that a slow compile cannot cost the other sets' rows); speedups recomputed."""
    if (a.target, a.phase, a.layers, a.gpu) != (b.target, b.phase, b.layers, b.gpu):
        raise ValueError(f"cannot merge bench results of {a.target}/{a.phase}/{a.layers} layers "
                         f"on {a.gpu} and {b.target}/{b.phase}/{b.layers} layers on {b.gpu}")
    kernels = a.kernels + [k for k in b.kernels if k not in a.kernels]
    rows = [dataclasses.replace(r, speedup={}) for r in a.rows + b.rows]
    _speedups(rows, kernels)
    stages = dict(a.stages)
    for k, v in b.stages.items():
        stages[f"{k} ({', '.join(b.kernels)})"] = v
    return dataclasses.replace(
        a, kernels=kernels, rows=rows, floors={**b.floors, **a.floors},
        notes=a.notes + [n for n in b.notes if n not in a.notes], stages=stages,
        attention_backend=a.attention_backend or b.attention_backend)


def load_result(path: str | Path) -> dict[str, Any]:
    import json

    data = json.loads(Path(path).read_text())
    if data.get("schema") != SCHEMA:
        raise TargetError(f"{path} is not an autoopt bench model result (schema "
                          f"{data.get('schema')!r}, expected {SCHEMA!r})")
    return data
