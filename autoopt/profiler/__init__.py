"""Where a target's step spends its time: `profile_step(target, batch) -> Profile`.

Attribution is made on an eager step: NVTX (and torch.profiler) ranges are host-side and are
not re-emitted when a CUDA graph replays, so kernels launched by a replay cannot be attributed.
Where the runtime would graph the step (decode on a GPU), the graph replay of the same step is
timed separately with CUDA events (`Profile.graph_step_us`); the attributed wall time is the
eager step's, and its time on no kernel is the "launch overhead / idle" line.

Backends: `ncu` (Nsight Compute in a child process: measured kernel durations and DRAM bytes;
an in-process torch.profiler pass of the same step supplies call counts and a CUPTI kernel-time
cross-check) and `torch` (torch.profiler alone: kernel times from CUPTI on a GPU, top-level aten
op times on the CPU; bytes from the op cost models). `auto` takes ncu on a GPU where it is
installed, else torch; a failed ncu run falls back to torch and says so.
"""

from __future__ import annotations

import dataclasses
import platform
import subprocess
from datetime import UTC, datetime
from pathlib import Path

import torch

from .. import env
from ..targets import Target, TargetError, load_target
from .attribution import OTHER, KernelRecord, Profile, Rates, align_by_order, attribute
from .workload import build_workload, default_device, free_workload, plan_layers

BACKENDS = ("auto", "ncu", "torch")
DEFAULT_BACKEND = "auto"
DEFAULT_KERNELS = "reference"
ATTRIBUTION_NOTE = (
    "kernels attributed on an eager step through NVTX/profiler ranges (ranges are not re-emitted "
    "under CUDA-graph replay); the graph replay, where captured, is timed separately "
    "(graph_step_us); idle = the attributed step's wall time - its kernel time")

__all__ = ["BACKENDS", "DEFAULT_BACKEND", "DEFAULT_KERNELS", "Profile", "local_rates",
           "profile_step", "time_step"]


def time_step(work, repeats: int = 3) -> tuple[float, float | None]:
    """Median eager step time and, if the step graphs, median graph-replay time, in µs.

    Timed by the project's one harness (`autoopt.eval.timing.time_callable`) with CUDA events,
    one step per sample: the step's weights are far larger than the L2, so no input rotation.
    """
    from ..eval.timing import time_callable

    dev = str(work.device)
    eager = time_callable(work.step, [()], device=dev, warmup=1, iters=repeats,
                          use_cuda_graph=False).median_us
    graph_us = None
    if work.capture_graph():
        graph_us = time_callable(work.graph.replay, [()], device=dev, warmup=1, iters=repeats,
                                 use_cuda_graph=False).median_us
    return eager, graph_us


def local_rates(target: Target, device: torch.device, proxy: str | None) -> Rates:
    """Measured ceilings of the local GPU (cached per GPU), else the target's datasheet values."""
    hw = target.hardware
    sheet = Rates(hw.hbm_tb_s * 1e12, hw.bf16_tflop_s * 1e12, hw.fp32_tflop_s * 1e12,
                  f"datasheet ({target.name})", meaningful=not hw.is_cpu)
    if device.type != "cuda":
        return sheet
    try:
        from ..eval.timing import measure_ceilings
    except ImportError:
        return Rates(sheet.bandwidth_bytes_s, sheet.bf16_flops_s, sheet.fp32_flops_s,
                     sheet.source + "; autoopt.eval.timing is not available to measure",
                     sheet.meaningful and proxy is None)
    c = measure_ceilings(str(device))
    return Rates(c.copy_bytes_s, c.bf16_flops_s, c.fp32_flops_s, f"measured on {c.gpu}",
                 bool(c.meaningful))


def _versions(ncu_version: str | None) -> dict[str, str]:
    v = {"python": platform.python_version(), "torch": torch.__version__,
         "cuda": str(torch.version.cuda)}
    try:
        import triton

        v["triton"] = triton.__version__
    except ImportError:
        v["triton"] = "not installed"
    if ncu_version:
        v["ncu"] = ncu_version
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=env.REPO_ROOT,
                             capture_output=True, text=True, timeout=10)
        v["git"] = out.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        v["git"] = "unknown"
    return v


def _choose_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise TargetError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    if backend == "auto":
        from .nsight import find_ncu

        return "ncu" if device.type == "cuda" and find_ncu() else "torch"
    if backend == "ncu" and device.type != "cuda":
        raise TargetError("the ncu backend needs a CUDA GPU; use --backend torch (or auto)")
    return backend


def profile_step(target: Target | str | Path, batch: int | None = None, layers: int | None = None,
                 kernels: str = DEFAULT_KERNELS, proxy: bool = False,
                 backend: str = DEFAULT_BACKEND,
                 context: int | None = None, seed: int = 0, ncu_timeout_s: float = 600.0,
                 repeats: int | None = None, registry: str | Path | None = None) -> Profile:
    """Profile one step of `target` at `batch` and return the attributed table; `tuned` and lock
    files take their variants from `registry` (default: the repo's kernels/)."""
    reg = str(registry) if registry is not None else None
    t = target if isinstance(target, Target) else load_target(target)
    batch = batch or t.batch_sizes[0]
    ctx = context or t.contexts[0]
    proxy_note = t.require_local_gpu(proxy)
    device = default_device(t)
    chosen = _choose_backend(backend, device)
    notes: list[str] = []
    ncu_run, ncu_note = None, ""
    n = layers or t.default_layers
    if device.type == "cuda":  # the ncu child must build the layer count the parent will
        n, why = plan_layers(t, batch, ctx, torch.cuda.mem_get_info(device)[0], layers)
        notes.append(why)
    if chosen == "ncu":
        from .nsight import NcuError, run_ncu

        try:
            ncu_run = run_ncu(str(t.source or t.name), batch, n, ctx, kernels, seed,
                              timeout_s=ncu_timeout_s, registry=reg)
            ncu_note = f"ncu {ncu_run.version} ({ncu_run.wall_s:.0f} s, read via {ncu_run.reader})"
        except NcuError as e:
            ncu_note = f"ncu failed, fell back to torch.profiler: {e}"
            notes.append(ncu_note)
    work = build_workload(t, batch, n, ctx, kernels, device, seed, registry=reg)
    try:
        notes += work.notes
        # CPU step times only inform (the CPU rows come from the profiled run): one repeat.
        eager_us, graph_us = time_step(work, repeats or (3 if device.type == "cuda" else 1))
        from .torch_trace import trace_step

        trace = trace_step(work, warmup=0)  # time_step warmed the step up
        graph_note, sources = work.graph_note, dict(work.model.ops.sources)
    finally:
        free_workload(work)
    p = _assemble(t, batch, ctx, n, kernels, seed, proxy_note, device, trace, ncu_run,
                  ncu_note, eager_us, graph_us, graph_note, notes)
    return dataclasses.replace(p, sources=sources)


def _assemble(t: Target, batch, ctx, n, kernels, seed, proxy_note, device, trace, ncu_run,
              ncu_note, eager_us, graph_us, graph_note, notes) -> Profile:
    cupti_us = sum(r.duration_us for r in trace.records)
    checks: dict = {"seed": seed, "torch_profiler_kernel_us": cupti_us, "eager_step_us": eager_us,
                    "graph": graph_note}
    records: list[KernelRecord] = trace.records
    backend, note = "torch", "torch.profiler" + (" (CPU ops)" if device.type == "cpu" else
                                                 " (CUPTI kernel times)")
    if ncu_run is not None:
        records, backend, note = ncu_run.records, "ncu", ncu_note
        unlabelled = sum(r.op == OTHER for r in records)
        if unlabelled > len(records) / 2:
            aligned = align_by_order(records, trace.records)
            if aligned is not None:
                records = aligned
                note += "; NVTX stacks missing, kernels labelled by launch order"
        ncu_us = sum(r.duration_us for r in records)
        checks["ncu_kernel_us"] = ncu_us
        checks["ncu_vs_torch_profiler_kernel_time"] = ncu_us / cupti_us if cupti_us else None
        checks["ncu_kernels"] = len(records)
        checks["torch_profiler_kernels"] = sum(r.kind == "kernel" for r in trace.records)
    elif ncu_note:
        note += f" ({ncu_note})"
    if device.type == "cpu":
        # CPU op times come from the profiled run; its own wall time keeps the idle line >= 0.
        step_us, step_source = trace.step_range_us, "profiled step range (host clock, CPU)"
    else:
        step_us, step_source = eager_us, "CUDA events, eager step, median"
    kernel_total = sum(r.duration_us for r in records)
    checks["kernel_time_vs_step"] = kernel_total / step_us if step_us else None
    if graph_us:
        checks["kernel_time_vs_graph_step"] = kernel_total / graph_us
    rates = local_rates(t, device, proxy_note)
    rows, kernel_us, floor_us = attribute(records, trace.calls, t.step_calls(batch, n, ctx),
                                          rates, step_us)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return Profile(
        target=t.name, phase=t.phase, batch=batch, context=ctx, layers=n, kernels=kernels,
        backend=backend, backend_note=note, gpu=gpu, proxy=proxy_note, rows=rows,
        step_us=step_us, step_source=step_source, kernel_us=kernel_us, floor_us=floor_us,
        rates=rates, graph_step_us=graph_us, attribution_note=ATTRIBUTION_NOTE,
        notes=tuple(notes), checks=checks, versions=_versions(
            ncu_run.version if ncu_run else None),
        created=datetime.now(UTC).isoformat(timespec="seconds"))
