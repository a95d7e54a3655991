"""Timing inside a TP group, and the communication floor of a TP step.

Every rank calls these together (their collectives pair up). `measure` times back-to-back calls
with CUDA events (wall clock on CPU); `measure_graph` captures them in a CUDA graph first (GPU
time without launch overhead; every rank replays or none does). `comm_floor` times the cheapest
exchanges a TP step needs at a token count: the boundary's exchange of [T, H] partials (the
one-shot all-reduce where it runs, NCCL's all-gather and all-reduce), and the vocabulary gather of
the logits. A decode step has 2 * layers boundaries and one embedding sum, so its communication
floor is (2 * layers + 1) x the fastest exchange + one vocabulary gather (`step_comm_floor_us`);
the TP step's floor is the per-rank floor (bytes / bandwidth) plus that.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from .parallel import TPGroup


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stats(samples: list[float]) -> dict:
    t = torch.tensor(samples, dtype=torch.float64)
    q = torch.quantile(t, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)).tolist()
    return {"median_us": q[1], "iqr_us": q[2] - q[0], "samples": len(samples)}


def measure(fn: Callable[[], object], group: TPGroup, warmup: int, repeats: int, inner: int,
            reset: Callable[[], None] | None = None) -> dict:
    """Per-call µs over `repeats` samples of `inner` back-to-back calls (median, IQR)."""
    for _ in range(warmup):
        if reset:
            reset()
        fn()
    _sync(group.device)
    group.barrier()
    samples = []
    for _ in range(repeats):
        if reset:
            reset()  # outside the timed region (an in-place all-reduce grows its buffer)
        if group.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / inner)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            samples.append((time.perf_counter() - t0) * 1e6 / inner)
    return stats(samples)


def measure_graph(fn: Callable[[], object], group: TPGroup, repeats: int, inner: int,
                  reset: Callable[[], None] | None = None) -> dict:
    """CUDA-graph replay of `inner` calls captured once (GPU time without launch overhead)."""
    stream = torch.cuda.Stream(group.device)
    stream.wait_stream(torch.cuda.current_stream(group.device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(group.device).wait_stream(stream)
    graph, error = torch.cuda.CUDAGraph(), None
    try:
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    # Every rank replays or none does: a lone replay would wait forever in its collectives.
    flag = torch.tensor([int(error is not None)], dtype=torch.int32, device=group.device)
    failed = group.gather_partials(flag)
    if bool(failed.any()):
        raise RuntimeError(error or f"capture failed on rank(s) {failed.nonzero()[:, 0].tolist()}")
    graph.replay()
    _sync(group.device)
    group.barrier()
    samples = []
    for _ in range(repeats):
        if reset:
            reset()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / inner)
    return stats(samples)


def best_of(fn: Callable[[], object], group: TPGroup, repeats: int = 20, inner: int = 20) -> dict:
    """Graph replay on GPUs where it captures (else eager): the fastest honest time of `fn`."""
    if group.device.type == "cuda":
        try:
            return {**measure_graph(fn, group, repeats, inner), "mode": "graph"}
        except RuntimeError as exc:
            note = str(exc)[:200]
            return {**measure(fn, group, 3, repeats, inner), "mode": "eager", "graph_error": note}
    return {**measure(fn, group, 1, repeats, inner), "mode": "eager"}


# ---- the communication floor ------------------------------------------------------------------
def comm_floor(group: TPGroup, tokens: int, hidden: int, vocab_shard: int, repeats: int = 20,
               inner: int = 20) -> dict:
    """µs of each exchange at `tokens` tokens on this group (collective; every rank calls it)."""
    dev = group.device
    g = torch.Generator(device=dev).manual_seed(11 + group.rank)
    x = torch.randn(tokens, hidden, generator=g, device=dev).to(torch.bfloat16)
    logits = torch.randn(tokens, vocab_shard, generator=g, device=dev).to(torch.bfloat16)
    buf = x.clone()
    out: dict = {"tokens": tokens, "hidden": hidden, "vocab_shard": vocab_shard}
    cases = {"nccl_allgather": lambda: group.gather_partials(x),
             "nccl_allreduce": lambda: dist.all_reduce(buf, group=group.pg),
             "vocab_gather": lambda: group.all_gather_vocab(logits)}
    peers = group.peers
    if peers is not None and peers.fits(x):
        cases["oneshot_allreduce"] = lambda: peers.all_reduce(x)
    for name, fn in cases.items():
        out[name] = best_of(fn, group, repeats, inner)
    if peers is not None and peers.fits(x):
        peers.check()
    exchanges = [out[k]["median_us"] for k in ("nccl_allgather", "nccl_allreduce",
                                               "oneshot_allreduce") if k in out]
    out["boundary_exchange_us"] = min(exchanges)
    return out


def step_comm_floor_us(floor: dict, layers: int) -> float:
    """A decode step's communication floor from `comm_floor` at its token count."""
    return (2 * layers + 1) * floor["boundary_exchange_us"] + floor["vocab_gather"]["median_us"]
