"""The one timing harness: CUDA-graph replay over rotating inputs, median and IQR, floors.

`time_callable` warms a callable up, then on cuda captures many calls over rotating input sets
(together larger than twice the L2, so every call reads from HBM) into one CUDA graph and times
replays with CUDA events; each sample is one replay divided by the calls in it. On CPU it times
single calls with a perf counter and labels the result not meaningful for speed.

`bench_op` times the reference, `torch.compile` of the reference (with
`emulate_precision_casts`, so it is the same function) and the candidate in one child process
run, and reports ratios and the fraction of the op's floor (bytes and FLOPs over the ceilings
that `measure_ceilings` measured once per GPU and cached).

The timers are bound at import, before any candidate is loaded, so a candidate that replaced
`time.perf_counter` or `torch.cuda.Event` would not change what the harness measures (the static
screen and the sandbox's monkeypatch check reject such a candidate anyway).
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

_perf_counter = time.perf_counter
_Event = torch.cuda.Event
_CUDAGraph = torch.cuda.CUDAGraph
H200_L2_BYTES = 50 << 20
# Decode-sized inputs are a few KB: spanning 2x L2 takes thousands of sets (clones are fine:
# what matters is that no set is still cached when its turn comes).
MAX_SETS = 4096
CPU_MAX_SETS = 4
DISTINCT_SETS = 8  # random sets made by the caller; the rest of the rotation are clones
GRAPH_TARGET_US = 2000.0  # a replay long enough that launch and event overhead vanish
MAX_CALLS_PER_GRAPH = 4096


@dataclass(frozen=True)
class Timing:
    median_us: float
    iqr_us: float
    samples: list[float]
    method: str  # "cuda-graph" | "cuda-events" | "cpu-perf-counter"
    meaningful: bool
    n_sets: int = 1
    calls_per_sample: int = 1
    notes: tuple[str, ...] = ()


def tensor_bytes(args: Sequence[Any]) -> int:
    return sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))


def sets_needed(bytes_per_set: int, l2_bytes: int, max_sets: int = MAX_SETS) -> int:
    """Input sets so the rotation spans at least twice the L2 (no set is still cached)."""
    if bytes_per_set <= 0:
        return 1
    return max(1, min(max_sets, math.ceil(2 * l2_bytes / bytes_per_set)))


def rotating_sets(make_one: Callable[[int], tuple], n: int, distinct: int = 4) -> list[tuple]:
    """n argument sets in distinct buffers: `distinct` random ones, the rest clones of them."""
    base = [make_one(k) for k in range(min(n, distinct))]
    out = list(base)
    for k in range(len(base), n):
        out.append(tuple(a.clone() if isinstance(a, torch.Tensor) else a
                         for a in base[k % len(base)]))
    return out


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
        cap = MAX_SETS if device.startswith("cuda") else CPU_MAX_SETS
        n = sets_needed(tensor_bytes(first[0]), _l2_bytes(device), cap)
        distinct = first + (list(make_args_sets(min(n, DISTINCT_SETS) - 1)) if n > 1 else [])
        arg_sets = rotating_sets(lambda k: distinct[k], n, distinct=len(distinct))
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
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for args in arg_sets:
                fn(*args)
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
    """The op's floor at `shape`: bytes over copy bandwidth, FLOPs over the matching rate."""
    cost = contract.cost(shape)
    rate = ceilings.fp32_flops_s if contract.name == "router" else ceilings.bf16_flops_s
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
    """Time reference, torch.compile and the variant (if any) at `shapes`, in one child run."""
    from model.ops import contract

    from .guards import static_screen
    from .sandbox import run_child

    contract(op)
    if variant_source is not None:
        variant_source = Path(variant_source).resolve()
        screen = static_screen(variant_source.read_text(), str(variant_source))
        if screen:
            raise ValueError(f"refusing to time {variant_source}: " + "; ".join(screen))
    params = {"op": op, "source": str(variant_source) if variant_source else None,
              "shapes": [dict(s) for s in shapes], "device": device, "warmup": warmup,
              "iters": iters, "compile": compile, "config": config, "git_commit": git_commit()}
    child = run_child("bench", params, timeout_s=timeout_s, device=device, perturb=False)
    if not child.ok or child.result is None:
        raise RuntimeError(f"benchmark of {op} failed in the sandbox: {child.error}")
    return [BenchRow(**row) for row in child.result["rows"]]


def bench_job(params: dict) -> dict:
    """Runs in the sandbox child; see `bench_op`."""
    from .bench import run_bench

    return {"rows": run_bench(params)}
