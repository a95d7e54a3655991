"""The one timing harness: CUDA-graph replay over distinct inputs, median and IQR, floors.

Two ways to time, one method:
- `time_callable` times trusted code in this process (the reference, torch.compile of it, the
  profiler's step, the built-in templates' tuning): it warms a callable up, then on cuda
  captures many calls over distinct input sets (together larger than twice the L2, so every call
  reads from HBM) into one CUDA graph and times replays with CUDA events; each sample is one
  replay divided by the calls in it. On CPU it times single calls with a perf counter and labels
  the result not meaningful for speed.
- `time_in_worker` times a candidate in its worker (the same burst that verification samples):
  distinct input sets, captured into a graph on cuda, then new content written into every set
  and the outputs poisoned, then timed replays. The worker reports CUDA-event times; the judge
  times the whole request with its own clock (minus a measured round trip) and believes the
  worker's numbers only when they agree (`CLOCK_AGREEMENT`); a sample of the timed calls' outputs
  is read back and judged against references of the new content. Timings that fail either check
  are marked invalid, and a candidate faster than its floor is impossible.

`measure_ceilings` measures copy bandwidth and matmul rates once per GPU (cached); `floor_us`
is the op's bytes and FLOPs over them. `bench_op` (bench.py) times reference, torch.compile and
the candidate and reports ratios and fractions of the floor.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from autoopt.env import cache_dir
from model.ops._contract import fp32_gemm_flops_s

from .trials import refill, shape_key
from .worker_burst import release_generators

_perf_counter = time.perf_counter
_Event = torch.cuda.Event
_CUDAGraph = torch.cuda.CUDAGraph
H200_L2_BYTES = 50 << 20
# Decode-sized inputs are a few KB: spanning 2x L2 takes thousands of sets (clones are fine:
# what matters is that no set is still cached when its turn comes).
MAX_SETS = 4096
CPU_MAX_SETS = 4
# Every set is distinct random data (no clones): a cache keyed by content cannot help. At least
# this many, and no more bytes than SET_BYTES_CAP in all (huge inputs: fewer, at least 2).
MIN_SETS = {"cuda": 8, "cpu": 3}
SET_BYTES_CAP = {"cuda": 8 << 30, "cpu": 256 << 20}
GRAPH_TARGET_US = 2000.0  # a replay long enough that launch and event overhead vanish
MAX_CALLS_PER_GRAPH = 4096
# The worker's own times must account for at least this fraction of the judge's wall clock
# (minus the round trip), and not exceed it, when the request ran long enough to tell.
CLOCK_AGREEMENT = (0.8, 1.05)
# A machine busy with other work (a second job on the GPU, compiles on the host) can stretch the
# judge's wall clock once; a worker that under-reports does so every time. Void after this many.
CLOCK_ATTEMPTS = 2
MIN_CHECKED_WALL_S = 0.005


@dataclass(frozen=True)
class Timing:
    median_us: float
    iqr_us: float
    samples: list[float]
    method: str  # "cuda-graph" | "cuda-events" | "cpu-perf-counter" (+ " in the worker")
    meaningful: bool
    n_sets: int = 1
    calls_per_sample: int = 1
    notes: tuple[str, ...] = ()
    valid: bool = True  # False: the judge's checks failed (clock disagreement, wrong outputs)
    wall_us: float | None = None  # per call, from the judge's own clock (worker timings)


def tensor_bytes(args: Sequence[Any]) -> int:
    return sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))


def sets_needed(bytes_per_set: int, l2_bytes: int, max_sets: int = MAX_SETS) -> int:
    """Input sets so the rotation spans at least twice the L2 (no set is still cached)."""
    if bytes_per_set <= 0:
        return 1
    return max(1, min(max_sets, math.ceil(2 * l2_bytes / bytes_per_set)))


def rotating_sets(make_one: Callable[[int], tuple], n: int) -> list[tuple]:
    """n argument sets, each its own random data in its own buffers."""
    return [make_one(k) for k in range(n)]


def set_count(bytes_per_set: int, device: str) -> int:
    """Distinct sets to time over: enough to span 2x the L2, at least MIN_SETS, within a cap."""
    kind = "cuda" if device.startswith("cuda") else "cpu"
    cap = MAX_SETS if kind == "cuda" else CPU_MAX_SETS
    n = max(MIN_SETS[kind], sets_needed(bytes_per_set, _l2_bytes(device), cap))
    return max(2, min(n, SET_BYTES_CAP[kind] // max(bytes_per_set, 1)))


def _l2_bytes(device: str) -> int:
    if device.startswith("cuda"):
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
                   or H200_L2_BYTES)
    return 32 << 20


def _summary(samples: list[float]) -> tuple[float, float]:
    if len(samples) < 4:
        return statistics.median(samples), 0.0
    q = statistics.quantiles(samples, n=4)
    return statistics.median(samples), q[2] - q[0]


def time_callable(fn: Callable[..., Any],
                  make_args_sets: Callable[[int], Sequence[tuple]] | Sequence[tuple], *,
                  device: str | torch.device, warmup: int = 10, iters: int = 50,
                  use_cuda_graph: bool = True) -> Timing:
    """Median and IQR of one call of `fn(*args)`, rotating over input sets.

    `make_args_sets(n)` returns n argument tuples (or pass the tuples themselves); the number of
    sets is chosen from the bytes of one set so the rotation exceeds the L2.
    """
    device = str(device)
    if callable(make_args_sets):
        first = list(make_args_sets(1))
        n = set_count(tensor_bytes(first[0]), device)
        arg_sets = first + (list(make_args_sets(n - 1)) if n > 1 else [])
    else:
        arg_sets = list(make_args_sets)
    if not arg_sets:
        raise ValueError("time_callable needs at least one argument set")
    if not device.startswith("cuda"):
        return _time_cpu(fn, arg_sets, warmup, iters)
    with torch.no_grad():
        for k in range(max(warmup, 1)):
            fn(*arg_sets[k % len(arg_sets)])
        torch.cuda.synchronize()
        if use_cuda_graph:
            try:
                return _time_graph(fn, arg_sets, iters)
            except Exception as e:  # a candidate that cannot be captured is still timed
                torch.cuda.synchronize()
                timing = _time_events(fn, arg_sets, iters)
                note = f"cuda graph capture failed ({type(e).__name__}: {e}); timed eagerly"
                return Timing(**{**asdict(timing), "notes": (note,)})
        return _time_events(fn, arg_sets, iters)


def _time_cpu(fn: Callable, arg_sets: list[tuple], warmup: int, iters: int) -> Timing:
    with torch.no_grad():
        for k in range(min(warmup, 3)):
            fn(*arg_sets[k % len(arg_sets)])
        samples = []
        for k in range(max(iters, 1)):
            t0 = _perf_counter()
            fn(*arg_sets[k % len(arg_sets)])
            samples.append((_perf_counter() - t0) * 1e6)
    med, iqr = _summary(samples)
    return Timing(med, iqr, samples, "cpu-perf-counter", False, len(arg_sets), 1,
                  ("cpu: not meaningful for speed",))


def _time_events(fn: Callable, arg_sets: list[tuple], iters: int) -> Timing:
    samples = []
    for _ in range(max(iters, 1)):
        start, end = _Event(enable_timing=True), _Event(enable_timing=True)
        start.record()
        for args in arg_sets:
            fn(*args)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / len(arg_sets))
    med, iqr = _summary(samples)
    return Timing(med, iqr, samples, "cuda-events", True, len(arg_sets), len(arg_sets))


def _time_graph(fn: Callable, arg_sets: list[tuple], iters: int) -> Timing:
    eager = _time_events(fn, arg_sets, 3).median_us
    reps = max(1, min(MAX_CALLS_PER_GRAPH // len(arg_sets),
                      math.ceil(GRAPH_TARGET_US / max(eager, 1e-3) / len(arg_sets))))
    # Eager timing of many tiny calls is launch-bound, so `eager` overestimates; that only makes
    # the graph shorter than the target, never wrong.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on the capture stream (allocator, lazy init)
        for args in arg_sets:
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = _CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(reps):
                for args in arg_sets:
                    fn(*args)
    except Exception:
        release_generators()
        raise
    calls = reps * len(arg_sets)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(max(iters, 1)):
        start, end = _Event(enable_timing=True), _Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    med, iqr = _summary(samples)
    return Timing(med, iqr, samples, "cuda-graph", True, len(arg_sets), calls)


@dataclass(frozen=True)
class Ceilings:
    copy_bytes_s: float  # read + write bytes per second of a device copy
    bf16_flops_s: float
    fp32_flops_s: float
    gpu: str
    meaningful: bool = True
    measured_at: str = ""


def _gpu_slug(name: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in name).strip("-").lower()


def measure_ceilings(device: str | torch.device, *, refresh: bool = False) -> Ceilings:
    """Copy bandwidth and BF16/FP32 matmul rates, cached per GPU name.

    On CPU it measures tiny sizes and is labelled meaningful=False (never cached)."""
    device = str(device)
    if not device.startswith("cuda"):
        return _measure(device, copy_mb=16, n_bf16=256, n_fp32=256, name="cpu", meaningful=False)
    name = torch.cuda.get_device_name(device)
    path = cache_dir() / "ceilings" / f"{_gpu_slug(name)}.json"
    if path.is_file() and not refresh:
        return Ceilings(**json.loads(path.read_text()))
    ceil = _measure(device, copy_mb=1024, n_bf16=8192, n_fp32=4096, name=name, meaningful=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(ceil), indent=2))
    return ceil


def _measure(device: str, *, copy_mb: int, n_bf16: int, n_fp32: int, name: str,
             meaningful: bool) -> Ceilings:
    # Bytes a kernel can move: the faster of a copy and an elementwise SM kernel. Under CUDA
    # graphs a same-dtype copy_ becomes a memcpy node on the copy engines (2.71 TB/s measured on
    # an H200), slower than the SM kernels we time against it (a Triton kernel reached 3.63 TB/s).
    src = torch.empty((copy_mb << 20) // 4, dtype=torch.float32, device=device).fill_(1)
    dst = torch.empty_like(src)
    best = min(min(time_callable(fn, [(src, dst)], device=device, warmup=3, iters=10).samples)
               for fn in (lambda a, b: b.copy_(a), lambda a, b: torch.neg(a, out=b)))
    copy = 2 * src.numel() * src.element_size() / (best * 1e-6)
    del src, dst
    rates = []
    for n, dtype in ((n_bf16, torch.bfloat16), (n_fp32, torch.float32)):
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False  # FP32 means FP32 (the router's GEMM)
        try:
            t = time_callable(torch.matmul, [(a, b)], device=device, warmup=3, iters=10)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev
        rates.append(2 * n**3 / (min(t.samples) * 1e-6))
    return Ceilings(copy, rates[0], rates[1], name, meaningful,
                    time.strftime("%Y-%m-%dT%H:%M:%S"))


def floor_us(contract: Any, shape: dict, ceilings: Ceilings) -> float:
    """The op's floor at `shape`: bytes over copy bandwidth, FLOPs over the matching rate (the
    router's FP32 GEMM at `fp32_gemm_flops_s`: FP32 FMAs or exact three-term BF16 products)."""
    cost = contract.cost(shape)
    rate = (fp32_gemm_flops_s(ceilings.bf16_flops_s, ceilings.fp32_flops_s)
            if contract.name == "router" else ceilings.bf16_flops_s)
    return cost.floor_s(ceilings.copy_bytes_s, rate) * 1e6


@dataclass
class BenchRow:
    op: str
    impl: str  # the variant timed ("reference" when no variant was given)
    shape: dict
    median_us: float
    iqr_us: float
    reference_us: float
    compile_us: float | None
    x_reference: float
    x_compile: float | None
    gb_s: float
    floor_us: float
    pct_of_floor: float
    floor_ok: bool
    meaningful: bool
    device: str
    gpu: str | None
    torch: str
    triton: str | None
    git_commit: str | None
    method: str = ""
    notes: list[str] = field(default_factory=list)
    # False when the judge's checks of the timing failed (worker clock disagreement, wrong
    # outputs of timed calls); floor_ok is then False too, so a caller voids the row.
    valid: bool = True
    wall_us: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def git_commit() -> str | None:
    import subprocess

    from autoopt.env import REPO_ROOT

    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def bench_op(op: str, variant_source: Path | None, shapes: list[dict], device: str, *,
             warmup: int = 10, iters: int = 50, compile: bool = True,
             config: dict | None = None, timeout_s: float = 600) -> list[BenchRow]:
    """Time reference, torch.compile and the variant (if any) at `shapes` (see bench.py)."""
    from .bench import bench_op as _bench_op

    return _bench_op(op, variant_source, shapes, device, warmup=warmup, iters=iters,
                     compile=compile, config=config, timeout_s=timeout_s)


# ---- timing a candidate in its worker ------------------------------------------------------

def time_in_worker(j: Any, shape: dict, secret: Any, *, warmup: int = 3,
                   iters: int = 20) -> Timing:
    """Time the candidate held by judge `j`'s worker at `shape`; checked by the judge."""
    c, w, device = j.c, j.w, j.device
    cuda = device.startswith("cuda")
    sets = [c.make_inputs(dict(shape), secret.seed(), device)]
    n = set_count(tensor_bytes(sets[0]), device)
    sets += [c.make_inputs(dict(shape), secret.seed(), device) for _ in range(n - 1)]
    handles = [j.put(a) for a in sets]
    setup = j._checked(w.request({"cmd": "burst_setup", "handles": handles, "reps": 1,
                                  "warmup": warmup, "graph": cuda}))
    notes = [setup["note"]] if setup.get("note") else []
    if "raised" in setup:
        raise RuntimeError(f"the candidate raised while being timed: {setup['raised']}")
    probe = j._checked(w.request({"cmd": "burst_run", "replays": 3}))
    per_replay_us = statistics.median(probe["samples_s"]) * 1e6
    reps = 1
    if cuda and setup.get("graph"):
        reps = max(1, min(MAX_CALLS_PER_GRAPH // n, math.ceil(GRAPH_TARGET_US /
                                                              max(per_replay_us, 1e-3))))
        if reps > 1:
            j._checked(w.request({"cmd": "burst_setup", "handles": handles, "reps": reps,
                                  "warmup": 1, "graph": True}))
    new = [refill(old, c.make_inputs(dict(shape), secret.seed(), device)) for old in sets]
    for h, old, fresh_args in zip(handles, sets, new, strict=True):
        for i, (a, b) in enumerate(zip(old, fresh_args, strict=True)):
            if a is not b and isinstance(a, torch.Tensor):
                j.write(h, i, b)
    w.request({"cmd": "burst_poison"})
    valid, attempts = False, 0
    while not valid and attempts < CLOCK_ATTEMPTS:
        attempts += 1
        rtt = w.rtt_s()
        t0 = _perf_counter()
        run = j._checked(w.request({"cmd": "burst_run", "replays": max(iters, 1)}))
        wall = max(_perf_counter() - t0 - rtt, 0.0)
        if "raised" in run:
            raise RuntimeError(f"the candidate raised while being timed: {run['raised']}")
        valid, more = _clock_check(sum(run["samples_s"]), wall)
    if attempts > 1:
        notes.append(f"clock check passed on attempt {attempts}" if valid else
                     f"clock check failed on all {CLOCK_ATTEMPTS} attempts")
    calls = int(run["calls_per_sample"])
    samples = [x * 1e6 / calls for x in run["samples_s"]]
    notes += more
    wrong = _timed_outputs_wrong(j, shape, handles, new, secret)
    if wrong:
        valid = False
        notes.append(wrong)
    j.drop(handles, burst=True)
    med, iqr = _summary(samples)
    method = ("cuda-graph" if setup.get("graph") else "cuda-events" if cuda else
              "cpu-perf-counter") + " in the worker"
    if not cuda:
        notes.append("cpu: not meaningful for speed")
    return Timing(med, iqr, samples, method, cuda, n, calls, tuple(notes), valid,
                  wall / (max(iters, 1) * calls) * 1e6)


def _clock_check(claimed_s: float, wall_s: float) -> tuple[bool, list[str]]:
    if wall_s < MIN_CHECKED_WALL_S:
        return True, []
    ratio = claimed_s / wall_s
    lo, hi = CLOCK_AGREEMENT
    if lo <= ratio <= hi:
        return True, []
    return False, [f"timing void: the worker's times ({claimed_s * 1e3:.2f} ms) disagree with the "
                   f"judge's clock ({wall_s * 1e3:.2f} ms, ratio {ratio:.2f}, allowed {lo}-{hi})"]


def _timed_outputs_wrong(j: Any, shape: dict, handles: list, new: list, secret: Any) -> str:
    """Read back a sample of the timed calls' outputs and judge them against the references."""
    from . import wire
    from .numerics import effective_policy, judge

    k_all = list(range(len(handles)))
    sample = secret.rng.sample(k_all, min(4, len(k_all)))
    refs = [j.reference(new[k]) for k in sample]
    expect = [j.expect(r) for r in refs]
    j.w.ensure(sum(wire.aligned(t.numel() * t.element_size()) for r in refs for t in r) + 8192)
    reply = j._checked(j.w.request({"cmd": "burst_export", "indices": sample, "expect": expect,
                                    "region": {"off": 0, "cap": j.w.arena.size}}))
    key = "timed " + shape_key(shape)
    for k, ref, exp, descs in zip(sample, refs, expect, reply["data"], strict=True):
        outs = j.w.unpack(descs, exp)
        if any(o is None for o in outs):
            return f"timing void: timed call {k} returned no well-formed outputs"
        j.record(key, new[k], tuple(o.to(j.device) for o in outs), ref)
    for i in range(len(refs[0]) if refs else 0):
        stats = j.stats.get((key, i))
        policy = effective_policy(j.c.numerics, j.dtypes[i], j.device)
        failed = judge(policy, stats, f"output {i} of timed calls at {shape_key(shape)}")
        if failed:
            return "timing void: " + failed[0]
    return ""


def timed_shape(j: Any, plan: Any) -> dict:
    """The plan's largest bucket (by bytes) that the trials judged. A bucket whose reference
    could not run here (attention's one-row-per-query form at T = 16384 gathers 256 GiB of
    keys: the judge's own out-of-memory, not the candidate's) was skipped by the trials, and its
    timed outputs could not be checked either."""
    from .trials import shape_key

    judged = {key for key, _ in j.stats}
    ranked = sorted(plan.buckets, key=lambda s: j.c.cost(s).bytes, reverse=True)
    return next((s for s in ranked if shape_key(s) in judged), ranked[-1])


def floor_check(j: Any, plan: Any, secret: Any, checks: dict) -> list[str]:
    """Time the candidate at the largest judged bucket; impossible speed or void timing fail."""
    from .guards import floor_violation

    shape = timed_shape(j, plan)
    try:
        timing = time_in_worker(j, shape, secret, warmup=3, iters=20)
    except RuntimeError as e:
        checks["floor"] = {"passed": False, "shape": shape, "error": str(e)}
        return [f"timing: {e}"]
    ceilings = measure_ceilings(j.device)
    floor = floor_us(j.c, shape, ceilings)
    why = floor_violation(timing.median_us, floor)
    reasons = ([why] if why else []) + [f"timing: {n}" for n in timing.notes
                                        if n.startswith("timing void")]
    checks["floor"] = {"passed": not reasons, "shape": shape, "median_us": timing.median_us,
                       "wall_us": timing.wall_us, "floor_us": floor, "gpu": ceilings.gpu,
                       "method": timing.method, "sets": timing.n_sets, "notes": list(timing.notes)}
    return reasons
