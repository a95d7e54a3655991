"""`bench_op`: the reference, torch.compile and a candidate timed the same way, ratios and floors.

The reference and torch.compile of it (with `emulate_precision_casts`, so it is the same
function) are trusted and timed in this process with `time_callable`; the candidate is timed in
its worker with `time_in_worker` (distinct inputs, new content before the timed replays, a
sample of timed outputs judged, the worker's clock checked against the judge's). All use
CUDA-graph replay over distinct input sets larger than the L2, so the ratios compare like with
like. Input seeds come from a secret drawn per call.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from .plan import Secret
from .timing import BenchRow, Timing, floor_us, git_commit, measure_ceilings, time_callable

log = logging.getLogger("autoopt.eval")  # one line per timed shape: where a slow bench spends


def _sets(c: Any, shape: dict, device: str, secret: Secret):
    return lambda n: [c.make_inputs(dict(shape), secret.seed(), device) for _ in range(n)]


def _compiled(reference: Any) -> Any:
    import torch._inductor.config as inductor_config

    # Without it Inductor drops the reference's intermediate BF16 casts (docs/numerics.md), and the
    # baseline would be a different, faster function.
    inductor_config.emulate_precision_casts = True
    # Python-int arguments (norm_residual_norm's add_index) differ between input sets and each
    # value compiles once; past dynamo's default recompile limit (8) it silently runs eager,
    # which on an H200 made the "compiled" baseline equal the reference at T >= 32.
    torch._dynamo.reset()
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))
    return torch.compile(reference, dynamic=False)


def _one_scalar_set(make: Any) -> Any:
    """`make`'s input sets with every non-tensor argument (norm_residual_norm's add_index, a
    MoE's expert offset) taken from the first set drawn: compiled code specialises on Python
    scalars, so each new value would compile again (tens of seconds a shape on an H200) or,
    past the recompile limit, run eagerly. The scalars set values, not the work, so the
    compiled baseline is timed at its best."""
    first: list[tuple] = []

    def sets(n: int) -> list[tuple]:
        out = list(make(n))
        if not first and out:
            first.append(out[0])
        return [tuple(a if isinstance(a, torch.Tensor) else f for a, f in zip(s, first[0],
                                                                             strict=True))
                for s in out]

    return sets


def _time_compile(c: Any, shape: dict, device: str, warmup: int, iters: int, secret: Secret,
                  compile: bool) -> tuple[Timing | None, str | None]:
    if not compile:
        return None, "torch.compile not timed (--no-compile)"
    try:
        fn = _compiled(c.reference)
        return time_callable(fn, _one_scalar_set(_sets(c, shape, device, secret)),
                             device=device, warmup=max(warmup, 2), iters=iters), None
    except Exception as e:  # noqa: BLE001 - recorded on the row; the other timings still count
        torch._dynamo.reset()
        return None, f"torch.compile failed: {type(e).__name__}: {str(e)[:200]}"


def bench_op(op: str, variant_source: Path | None, shapes: list[dict], device: str, *,
             warmup: int = 10, iters: int = 50, compile: bool = True,
             config: dict | None = None, timeout_s: float = 600,
             on_row: Callable[[BenchRow], None] | None = None) -> list[BenchRow]:
    """Time reference, torch.compile and the variant (if any) at `shapes`, shape by shape (all
    three side by side before the next shape); `on_row(row)` as each shape's row is made, so a
    caller whose time runs out keeps the shapes that were timed."""
    from model.ops import contract
    from model.ops.precision import contract_precision

    from .screen import static_screen
    from .verify import run_env

    c = contract(op)
    text = None
    if variant_source is not None:
        variant_source = Path(variant_source).resolve()
        text = variant_source.read_bytes()
        screen = static_screen(text.decode("utf-8", "replace"), str(variant_source))
        if screen:
            raise ValueError(f"refusing to time {variant_source}: " + "; ".join(screen))
    secret = Secret()
    env = run_env(device)
    env["git_commit"] = git_commit()
    impl = variant_source.stem if variant_source is not None else "reference"
    rows: list[BenchRow] = []
    with contract_precision(), _candidate(c, text, device, config, timeout_s, secret) as cand:
        ceilings = measure_ceilings(device)
        for shape in shapes:
            t0 = time.monotonic()
            ref = time_callable(c.reference, _sets(c, shape, device, secret), device=device,
                                warmup=warmup, iters=iters)
            comp, note = _time_compile(c, shape, device, warmup, iters, secret, compile)
            log.info("%s: reference%s timed at %s in %.1f s", c.name,
                     " and torch.compile" if comp else "", _label(shape),
                     time.monotonic() - t0)
            t = ref
            if cand is not None:
                t0 = time.monotonic()
                t = cand(dict(shape), warmup, iters)
                log.info("%s: candidate timed at %s in %.1f s", c.name, _label(shape),
                         time.monotonic() - t0)
            rows.append(_row(c, impl, dict(shape), t, ref, comp, note, ceilings, env, device))
            if on_row is not None:
                on_row(rows[-1])
    return rows


@contextlib.contextmanager
def _candidate(c: Any, text: bytes | None, device: str, config: dict | None, timeout_s: float,
               secret: Secret) -> Iterator[Callable[[dict, int, int], Timing] | None]:
    """A function that times the candidate at a shape in its worker (started once, for every
    shape), or None without a candidate. After the last shape the worker is asked what it
    tried that was blocked."""
    if text is None:
        yield None
        return
    from .channel import Worker, WorkerError
    from .run import POISON_DTYPES, palette_bits, start_candidate
    from .timing import time_in_worker
    from .trials import Judge
    from .verify import CPU_MEM_LIMIT

    cuda = device.startswith("cuda")
    with Worker(device, budget_s=timeout_s, mem_limit_bytes=None if cuda else CPU_MEM_LIMIT,
                arena_bytes=64 << 20) as w:
        try:
            palettes = {dt: secret.palette(dt) for dt in POISON_DTYPES}
            err = start_candidate(w, text, device, config, palettes, secret.seed())
            if err:
                raise RuntimeError(f"benchmark of {c.name} failed: {err}")
            j = Judge(c, w, device, palette_bits(palettes))
            yield lambda shape, warmup, iters: time_in_worker(j, shape, secret, warmup=warmup,
                                                              iters=iters)
            blocked = w.request({"cmd": "ping"})["blocked"]
        except WorkerError as e:
            raise RuntimeError(f"benchmark of {c.name} failed in its worker: {e}") from None
    if blocked:
        raise RuntimeError(f"the variant attempted blocked operations: {blocked[:3]}")


def _label(shape: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in shape.items())


def _row(c: Any, impl: str, shape: dict, t: Timing, ref: Timing, comp: Timing | None,
         note: str | None, ceilings: Any, env: dict, device: str) -> BenchRow:
    from .guards import floor_violation

    floor = floor_us(c, shape, ceilings)
    cost = c.cost(shape)
    notes = list(t.notes) + ([note] if note else [])
    meaningful = t.meaningful and ceilings.meaningful
    why = floor_violation(t.median_us, floor) if meaningful else None
    if why:
        notes.append(why)
    return BenchRow(
        op=c.name, impl=impl, shape=dict(shape), median_us=t.median_us, iqr_us=t.iqr_us,
        reference_us=ref.median_us, compile_us=comp.median_us if comp else None,
        x_reference=ref.median_us / t.median_us,
        x_compile=comp.median_us / t.median_us if comp else None,
        gb_s=cost.bytes / (t.median_us * 1e-6) / 1e9, floor_us=floor,
        pct_of_floor=100.0 * floor / t.median_us, floor_ok=why is None and t.valid,
        meaningful=meaningful, device=device, gpu=env["gpu"], torch=env["torch"],
        triton=env["triton"], git_commit=env.get("git_commit"), method=t.method, notes=notes,
        valid=t.valid, wall_us=t.wall_us)
