"""Where a target's served step spends its time: `profile_step(target, batch) -> Profile`.

The step profiled is the one the server runs (served.py): the target's rank model in
`model/serve`'s engine, a paged KV cache pre-filled to the target's context, real sequences, and
on a GPU the decode step's CUDA-graph replay. Its ops and their shapes are recorded from that
step's own forward (inventory.py), its floor counts the weights its routing touched plus its KV
traffic (floor.py), and its kernel time is attributed to ops inside the graph replay by aligning
the replay's kernel trace with an eager pass of the same forward (graph_trace.py). `eager=True`
profiles the eager step instead (ops ranges apply directly); prefill and CPU steps are eager.

Backend: torch.profiler (CUPTI kernel times on a GPU, top-level aten ops on the CPU). Nsight
Compute is used only where it is worth its cost: `ncu_sample=N` replays up to N kernels of the
top ops in a child process (nsight.py) and adds their measured DRAM bytes; never the whole step.
"""

from __future__ import annotations

import dataclasses
import platform
import statistics
import subprocess
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

import torch

from .. import env
from ..targets import Target, TargetError, load_target
from .attribution import OTHER, KernelRecord, Profile, Rates, attribute
from .rank import build_rank_model, default_device, free_model, plan_layers

BACKENDS = ("auto", "torch", "ncu")
DEFAULT_BACKEND = "auto"
DEFAULT_KERNELS = "reference"
GRAPH_NOTE = ("kernel times from the CUDA-graph replay of the served step (CUPTI); each replayed "
              "kernel labelled with its op by aligning the replay's kernel sequence with an "
              "eager pass of the same static-buffer forward inside op ranges")
EAGER_NOTE = ("kernels attributed on the eager served step through profiler ranges; idle = the "
              "step's wall time - its kernel time")
_RATES: dict[str, Rates] = {}

__all__ = ["BACKENDS", "DEFAULT_BACKEND", "DEFAULT_KERNELS", "Profile", "local_rates",
           "profile_batches", "profile_step", "versions"]


def local_rates(target: Target, device: torch.device, proxy: str | None = None) -> Rates:
    """Ceilings measured on the local GPU in this process (once), else the target's datasheet
    values (CPU targets: nominal, not meaningful)."""
    hw = target.hardware
    sheet = Rates(hw.hbm_tb_s * 1e12, hw.bf16_tflop_s * 1e12, hw.fp32_tflop_s * 1e12,
                  f"datasheet ({target.name})", meaningful=not hw.is_cpu)
    if device.type != "cuda":
        return sheet
    key = str(device)
    if key not in _RATES:
        from ..eval.timing import measure_ceilings

        c = measure_ceilings(str(device), refresh=True)
        _RATES[key] = Rates(c.copy_bytes_s, c.bf16_flops_s, c.fp32_flops_s,
                            f"measured on {c.gpu} in this process", bool(c.meaningful))
    return _RATES[key]


def versions(extra: dict[str, str] | None = None) -> dict[str, str]:
    v = {"python": platform.python_version(), "torch": torch.__version__,
         "cuda": str(torch.version.cuda)}
    try:
        import triton

        v["triton"] = triton.__version__
    except ImportError:
        v["triton"] = "not installed"
    try:
        # "-dirty" when the tree differs from the commit: numbers from uncommitted code (or a
        # copy of a tree whose history is older than its files) do not claim a commit.
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7",
                              "--exclude", "*"], cwd=env.REPO_ROOT,
                             capture_output=True, text=True, timeout=10)
        v["git"] = out.stdout.strip() or "unknown"
    except (OSError, subprocess.TimeoutExpired):
        v["git"] = "unknown"
    return v | (extra or {})


def _check_backend(backend: str, device: torch.device) -> None:
    if backend not in BACKENDS:
        raise TargetError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
    if backend == "ncu" and device.type != "cuda":
        raise TargetError("the ncu backend needs a CUDA GPU; use --backend torch (or auto)")


def profile_step(target: Target | str | Path, batch: int | None = None, layers: int | None = None,
                 kernels: str = DEFAULT_KERNELS, proxy: bool = False,
                 backend: str = DEFAULT_BACKEND, context: int | None = None, seed: int = 0,
                 repeats: int | None = None, registry: str | Path | None = None,
                 eager: bool = False, attention_backend: str = "auto",
                 ncu_sample: int = 0, ncu_timeout_s: float = 300.0) -> Profile:
    """Profile one served step of `target` at `batch` (see the module docstring)."""
    t = target if isinstance(target, Target) else load_target(target)
    return profile_batches(t, [batch or t.batch_sizes[0]], layers=layers, kernels=kernels,
                           proxy=proxy, backend=backend, context=context, seed=seed,
                           repeats=repeats, registry=registry, eager=eager,
                           attention_backend=attention_backend, ncu_sample=ncu_sample,
                           ncu_timeout_s=ncu_timeout_s)[0]


def profile_batches(target: Target | str | Path, batches: Sequence[int], *,
                    layers: int | None = None, kernels: str = DEFAULT_KERNELS,
                    proxy: bool = False, backend: str = DEFAULT_BACKEND,
                    context: int | None = None, seed: int = 0, repeats: int | None = None,
                    registry: str | Path | None = None, eager: bool = False,
                    attention_backend: str = "auto", ncu_sample: int = 0,
                    ncu_timeout_s: float = 300.0, deadline: float | None = None
                    ) -> list[Profile]:
    """One profile per batch size, from one model and one engine (built for the largest)."""
    from .kernel_sets import kernel_set
    from .served import ServedStep, ServeShape

    t = target if isinstance(target, Target) else load_target(target)
    proxy_note = t.require_local_gpu(proxy)
    device = default_device(t)
    _check_backend(backend, device)
    ctx = context or t.contexts[0]
    notes: list[str] = []
    n = layers or t.default_layers
    if device.type == "cuda":
        n, why = plan_layers(t, max(batches), ctx, torch.cuda.mem_get_info(device)[0], layers)
        notes.append(why)
    rank = build_rank_model(t, n, device, seed)
    notes += rank.notes
    served = None
    try:
        kset = kernel_set(kernels, device, registry)
        rank.model.set_ops(kset.table)
        notes += list(kset.notes)
        rates = local_rates(t, device, proxy_note)
        reps = repeats or (10 if device.type == "cuda" else 1)
        served = ServedStep(rank.model, ServeShape(t.phase, max(batches), ctx,
                                                   steps=4 * (reps + 6) + 8),
                            cuda_graphs=not eager, attention_backend=attention_backend,
                            seed=seed)
        notes += served.notes
        out = []
        for b in batches:
            import time

            if deadline is not None and out and time.monotonic() > deadline:
                notes.append(f"batch {b} not profiled: the profiling deadline passed")
                break
            served.start(b)
            p = _profile_one(t, served, b, rank.layers, kernels, seed, proxy_note, rates, reps,
                             notes)
            out.append(dataclasses.replace(p, sources=dict(served.model.ops.sources)))
    finally:
        if served is not None:
            served.close()
        free_model(rank)
    if ncu_sample or backend == "ncu":
        # After the model and its KV cache are handed back: ncu's child builds its own model
        # on the same GPU, and the served step's cache would leave it no room.
        from .nsight import sample_top_kernels

        out = [sample_top_kernels(p, ncu_sample or 32, registry, ncu_timeout_s) for p in out]
    return out


def _time_steps(served, reps: int) -> list[float]:
    served.ensure(reps + 2)
    served.step()  # warm-up (a freshly started batch: first replay of its bucket)
    return [served.step() * 1e6 for _ in range(reps)]


def _profile_one(t: Target, served, batch: int, layers: int, kernels: str, seed: int,
                 proxy_note: str | None, rates: Rates, reps: int, notes: list[str]) -> Profile:
    from .floor import step_floor
    from .graph_trace import gaps, trace_served
    from .inventory import record_step

    device = served.device
    samples = _time_steps(served, reps)
    step_us = statistics.median(samples)
    served.ensure(4)
    calls, _ = record_step(served)
    counts: dict[str, int] = {}
    for c in calls:
        counts[c.name] = counts.get(c.name, 0) + c.count
    tr = trace_served(served)
    labelled = tr.labelled
    checks: dict = {"seed": seed, "step_samples_us": samples,
                    "kernels_per_step": sum(r.kind in ("kernel", "cpu")
                                            for r in labelled.records)}
    lines = None
    graph_us = None
    bucket = served.bucket()
    if tr.aligned is not None:
        al = tr.aligned
        g = gaps(al.records)
        records: list[KernelRecord] = al.records
        lines, graph_us = g.lines(step_us), g.graph_span_us
        checks.update(graph_bucket=bucket, aligned_fraction=al.fraction,
                      replay_kernels=al.replay_kernels, labelled_kernels=al.labelled_kernels,
                      kernels_in_graph=sum(r.in_graph for r in records),
                      graph_idle_us=g.graph_idle_us,
                      kernels_per_step=sum(r.kind == "kernel" for r in records))
        if sum(r.in_graph for r in records) < 0.5 * al.labelled_kernels:
            notes = notes + ["the replay's kernels were not visible to the profiler: attributed "
                             "with the eager pass's times"]
            records, lines = labelled.records, None
        note, source = GRAPH_NOTE, "engine.step(), CUDA-graph replay, median (host clock)"
    elif device.type == "cpu":
        records, note = labelled.records, EAGER_NOTE + " (CPU: top-level aten ops)"
        # CPU op times come from the profiled run; its own wall time keeps the idle line >= 0.
        step_us, source = labelled.step_range_us, "profiled step (host clock, CPU)"
    else:
        records, note = labelled.records, EAGER_NOTE
        source = "engine.step(), eager, median (host clock)"
    rows, kernel_us, _ = attribute(records, counts, calls, rates, step_us, lines)
    floor = step_floor(calls, served.model, t.phase, batch, served.shape.context, rates)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    checks["kernel_time_vs_step"] = kernel_us / step_us if step_us else None
    unlabelled = Counter(r.name for r in records if r.op == OTHER)
    checks["unlabelled_kernels"] = sum(unlabelled.values())
    # What runs outside every op's range, by name: work no op owns, so no agent is asked for it.
    checks["unlabelled_by_name"] = dict(unlabelled.most_common(12))
    return Profile(
        target=t.name, phase=t.phase, batch=batch, context=served.shape.context, layers=layers,
        kernels=kernels, backend="torch", backend_note="torch.profiler" + (
            " (CUPTI kernel times)" if device.type == "cuda" else " (CPU ops)"),
        gpu=gpu, proxy=proxy_note, rows=rows, step_us=step_us, step_source=source,
        kernel_us=kernel_us, floor_us=floor.floor_us, rates=rates, graph_step_us=graph_us,
        attribution_note=note, notes=tuple(notes), checks=checks, versions=versions(),
        created=datetime.now(UTC).isoformat(timespec="seconds"), floor=floor.to_dict(),
        attention_backend=served.engine.runner.attention_backend)
