"""The benchmark job, run inside the sandbox child (see `timing.bench_op`).

Reference and torch.compile timings are taken first, then the candidate is imported (after the
sandbox is armed) and timed in the same process, so the ratios compare like with like.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .timing import Timing, floor_us, measure_ceilings, rotating_sets, time_callable

INPUT_SEED = 1000  # benchmark inputs never reuse verification seeds


def _sets(c: Any, shape: dict, device: str):
    return lambda n: rotating_sets(lambda k: c.make_inputs(shape, INPUT_SEED + k, device), n)


def _compiled(reference: Any) -> Any:
    import torch._inductor.config as inductor_config

    # Without it Inductor drops the reference's intermediate BF16 casts (NUMERICS.md), and the
    # baseline would be a different, faster function.
    inductor_config.emulate_precision_casts = True
    # Python-int arguments (norm_residual_norm's add_index) differ between rotating input sets and
    # each value compiles once; past dynamo's default recompile limit (8) it silently runs eager,
    # which on an H200 made the "compiled" baseline equal the reference at T >= 32.
    torch._dynamo.reset()
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))
    return torch.compile(reference, dynamic=False)


def _time_compile(c: Any, shape: dict, params: dict) -> tuple[Timing | None, str | None]:
    if not params.get("compile", True):
        return None, "torch.compile not timed (--no-compile)"
    try:
        fn = _compiled(c.reference)
        return time_callable(fn, _sets(c, shape, params["device"]), device=params["device"],
                             warmup=max(params["warmup"], 2), iters=params["iters"]), None
    except Exception as e:  # recorded on the row; the other timings still count
        torch._dynamo.reset()
        return None, f"torch.compile failed: {type(e).__name__}: {str(e)[:200]}"


def run_bench(params: dict) -> list[dict]:
    from model.ops import contract

    from . import guards, sandbox
    from .candidates import load_variant
    from .verify import run_env

    device = params["device"]
    c = contract(params["op"])
    torch.backends.cuda.matmul.allow_tf32 = False
    env = run_env(device)
    ceilings = measure_ceilings(device)
    base = []
    for shape in params["shapes"]:
        ref = time_callable(c.reference, _sets(c, shape, device), device=device,
                            warmup=params["warmup"], iters=params["iters"])
        comp, note = _time_compile(c, shape, params)
        base.append((shape, ref, comp, note))
    impl, cand = "reference", None
    if params.get("source"):
        snapshot = guards.snapshot_globals()
        sandbox.arm(params["source"])
        variant = load_variant(Path(params["source"]))
        impl = variant.name
        config = params.get("config")

        def cand(*a):
            return variant.run(*a, config=config)

    rows = []
    for shape, ref, comp, note in base:
        t = ref if cand is None else time_callable(
            cand, _sets(c, shape, device), device=device, warmup=params["warmup"],
            iters=params["iters"])
        rows.append(_row(c, impl, shape, t, ref, comp, note, ceilings, env, params))
    if cand is not None:
        patched = guards.patched_globals(snapshot)
        if patched:
            raise RuntimeError(f"the variant monkeypatched {', '.join(patched[:5])}: "
                               f"its timings are void")
    blocked = sandbox.blocked_events()
    if blocked:
        raise RuntimeError(f"the variant attempted blocked operations: {blocked[:3]}")
    return rows


def _row(c, impl, shape, t: Timing, ref: Timing, comp: Timing | None, note, ceilings, env,
         params) -> dict:
    from .guards import floor_violation

    floor = floor_us(c, shape, ceilings)
    cost = c.cost(shape)
    notes = list(t.notes) + ([note] if note else [])
    meaningful = t.meaningful and ceilings.meaningful
    why = floor_violation(t.median_us, floor) if meaningful else None
    if why:
        notes.append(why)
    return {
        "op": c.name, "impl": impl, "shape": dict(shape), "median_us": t.median_us,
        "iqr_us": t.iqr_us, "reference_us": ref.median_us,
        "compile_us": comp.median_us if comp else None,
        "x_reference": ref.median_us / t.median_us,
        "x_compile": comp.median_us / t.median_us if comp else None,
        "gb_s": cost.bytes / (t.median_us * 1e-6) / 1e9,
        "floor_us": floor, "pct_of_floor": 100.0 * floor / t.median_us,
        "floor_ok": why is None, "meaningful": meaningful, "device": params["device"],
        "gpu": env["gpu"], "torch": env["torch"], "triton": env["triton"],
        "git_commit": params.get("git_commit"), "method": t.method, "notes": notes,
    }
