"""moe_experts on one GPU at a TP8 rank's shapes: correctness, timing, a config sweep.

    python benchmarks/moe_gpu.py --out $OUT          (one H200, under 5 minutes)
    python benchmarks/moe_gpu.py --quick --out $OUT  (one H200, ~100 s: checks, timings, and
                                                      the best triton_v1 config per T)
    python benchmarks/moe_gpu.py --dry-run --out DIR (CPU, Triton interpreter, tiny shapes)

Shapes: H=5120, E=256 experts, I=320, top-8, routed scale 2.5, T = 1, 2, 4, 8, 16, 32, 64, 2048;
random weights (N(0, 1/fan_in)) and skewed routing (expert popularity falling 15x across ids).
1. Correctness: triton_v1 (its defaults) and grouped_mm_v2 against the reference, judged by the
   contract's policy (ulps at the scale of the combined terms); the raw output ulps are reported.
2. Timing: CUDA-graph replay (autoopt.eval.time_callable) over calls that rotate across SETS
   layers' worth of expert weights (2.5 GB each, far beyond the 50 MB L2) with a fresh routing per
   call: reference (eager; it syncs with the host), grouped_mm_v2, torch.compile of grouped_mm_v2
   (`emulate_precision_casts`; at --compile-tokens, where time allows), triton_v1 defaults, the
   sweep, and any variant named with --also (cute_v2 needs nvidia-cutlass-dsl).
3. Sweep: triton_v1 kernel-A configs (gate_up + SwiGLU) at a fixed kernel B, then kernel-B
   configs (down + combine) at the best A, then the grouped path; every config is also checked
   against the reference. Compilation runs in parallel worker processes first (Triton's cache).
--quick: 1. at every T; 2. without torch.compile, timing the reference only at T <= 8 (it
syncs with the host); 3. replaced by whole configs per T (QUICK_SWEEP), each checked and timed,
the default config among them; the fastest correct one per T is written as `best_configs`
({"T=1": {...}, ...}, the registry's tuned-config form).
Floor: bytes of the experts actually hit (distinct held ids of each call) plus x, out, ids and
weights, over the copy bandwidth measured in this process (`measure_ceilings(refresh=True)`).
Kernels per call: CUDA kernel launches in one profiled call.
Writes results.json and results.md under --out; prints a short table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

RANK = {"H": 5120, "E": 256, "I": 320, "k": 8}
TOKENS = (1, 2, 4, 8, 16, 32, 64, 2048)
DRY = {"H": 64, "E": 16, "I": 32, "k": 8}
DRY_TOKENS = (1, 3)
SCALE = 2.5
# Kernel A (gate_up + SwiGLU) and kernel B (down + combine) of the decode path, swept apart.
A_SWEEP = [
    {"MMA": True, "BLOCK_M": 16, "BLOCK_N": 8, "BLOCK_K": 256, "A_WARPS": 4, "A_STAGES": 4},
    {"MMA": True, "BLOCK_M": 16, "BLOCK_N": 8, "BLOCK_K": 512, "A_WARPS": 4, "A_STAGES": 3},
    {"MMA": True, "BLOCK_M": 16, "BLOCK_N": 8, "BLOCK_K": 128, "A_WARPS": 2, "A_STAGES": 5},
    {"MMA": True, "BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 256, "A_WARPS": 4, "A_STAGES": 4},
    {"MMA": True, "BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 128, "A_WARPS": 4, "A_STAGES": 5},
    {"MMA": True, "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "A_WARPS": 4, "A_STAGES": 4},
    {"MMA": False, "BLOCK_M": 1, "BLOCK_N": 4, "BLOCK_K": 512, "A_WARPS": 4, "A_STAGES": 3},
    {"MMA": False, "BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": 256, "A_WARPS": 4, "A_STAGES": 3},
    {"MMA": False, "BLOCK_M": 1, "BLOCK_N": 8, "BLOCK_K": 512, "A_WARPS": 8, "A_STAGES": 3},
    {"MMA": False, "BLOCK_M": 2, "BLOCK_N": 4, "BLOCK_K": 256, "A_WARPS": 4, "A_STAGES": 3},
]
B_SWEEP = [
    {"BLOCK_H": 16, "BLOCK_I": 64, "B_WARPS": 4, "B_STAGES": 3},
    {"BLOCK_H": 8, "BLOCK_I": 64, "B_WARPS": 4, "B_STAGES": 3},
    {"BLOCK_H": 4, "BLOCK_I": 64, "B_WARPS": 2, "B_STAGES": 3},
    {"BLOCK_H": 16, "BLOCK_I": 32, "B_WARPS": 4, "B_STAGES": 4},
    {"BLOCK_H": 32, "BLOCK_I": 64, "B_WARPS": 8, "B_STAGES": 3},
    {"BLOCK_H": 16, "BLOCK_I": 64, "B_WARPS": 8, "B_STAGES": 2},
    {"BLOCK_H": 16, "BLOCK_I": 64, "B_WARPS": 4, "B_STAGES": 3, "PDL": True},
    {"BLOCK_H": 8, "BLOCK_I": 64, "B_WARPS": 4, "B_STAGES": 3, "PDL": True},
]
G_SWEEP = [
    {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 64, "A_WARPS": 4, "A_STAGES": 4,
     "BLOCK_H": 64, "BLOCK_I": 64, "B_WARPS": 4, "B_STAGES": 3},
    {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "A_WARPS": 8, "A_STAGES": 3,
     "BLOCK_H": 128, "BLOCK_I": 64, "B_WARPS": 8, "B_STAGES": 3},
    {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 128, "A_WARPS": 4, "A_STAGES": 3,
     "BLOCK_H": 64, "BLOCK_I": 64, "B_WARPS": 4, "B_STAGES": 2},
    {"BLOCK_M": 128, "BLOCK_N": 32, "BLOCK_K": 64, "A_WARPS": 8, "A_STAGES": 3,
     "BLOCK_H": 64, "BLOCK_I": 64, "B_WARPS": 8, "B_STAGES": 3},
    {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 128, "A_WARPS": 4, "A_STAGES": 4,
     "BLOCK_H": 32, "BLOCK_I": 64, "B_WARPS": 4, "B_STAGES": 3},
]

# --quick: whole triton_v1 configs per T. Decode kernel A wants enough equal CTAs resident at
# once to keep HBM busy: at T = 1..4 few experts are hit, so K is split (SPLIT_K) or rows are
# cut finer; kernel B (down + combine) optionally as a programmatic dependent launch that
# prefetches its down rows into L2 while A drains (PDL, PREFETCH).
_B8 = {"BLOCK_H": 8, "BLOCK_I": 64, "B_WARPS": 4, "B_STAGES": 3}


def _dec(mma: bool, bm: int, bn: int, bk: int, stages: int, split: int, warps: int = 4,
         **more) -> dict:
    return {"PATH": "decode", "MMA": mma, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
            "A_WARPS": warps, "A_STAGES": stages, "SPLIT_K": split, **_B8, **more}


_PDL = {"PDL": True}
_PDL_PF = {"PDL": True, "PREFETCH": True}
QUICK_SWEEP = {
    1: [_dec(True, 16, 8, 128, 4, 2), _dec(True, 16, 8, 128, 4, 4), _dec(True, 16, 8, 256, 3, 2),
        _dec(False, 1, 4, 512, 3, 1), _dec(False, 1, 8, 256, 4, 2),
        _dec(True, 16, 8, 128, 4, 2, **_PDL), _dec(True, 16, 8, 128, 4, 2, **_PDL_PF),
        _dec(False, 1, 4, 256, 4, 2, **_PDL_PF)],
    2: [_dec(True, 16, 8, 128, 4, 2), _dec(True, 16, 8, 128, 4, 1), _dec(True, 16, 8, 256, 4, 1),
        _dec(False, 2, 4, 256, 3, 1), _dec(False, 2, 4, 256, 4, 2),
        _dec(True, 16, 8, 128, 4, 2, **_PDL), _dec(True, 16, 8, 128, 4, 2, **_PDL_PF),
        _dec(True, 16, 8, 128, 4, 1, **_PDL_PF)],
    4: [_dec(True, 16, 8, 256, 4, 1), _dec(True, 16, 8, 128, 4, 1), _dec(True, 16, 8, 128, 4, 2),
        _dec(True, 16, 16, 128, 4, 2), _dec(False, 4, 4, 128, 3, 1),
        _dec(True, 16, 8, 128, 4, 1, **_PDL), _dec(True, 16, 8, 128, 4, 1, **_PDL_PF),
        {**_dec(True, 16, 8, 128, 4, 1), "BLOCK_H": 16, "B_WARPS": 8}],
    8: [_dec(True, 16, 8, 256, 4, 1), _dec(True, 16, 8, 128, 4, 1), _dec(True, 16, 16, 128, 4, 1),
        _dec(True, 16, 8, 128, 4, 2), _dec(True, 16, 8, 128, 4, 1, warps=2),
        _dec(True, 16, 8, 128, 4, 1, **_PDL), _dec(True, 16, 8, 128, 4, 1, **_PDL_PF),
        {**_dec(True, 16, 8, 128, 4, 1), "BLOCK_H": 16, "B_WARPS": 8}],
    16: [_dec(True, 16, 8, 128, 4, 1), _dec(True, 16, 16, 128, 4, 1),
         _dec(True, 16, 8, 128, 4, 1, **_PDL_PF)],
    32: [_dec(True, 16, 8, 128, 4, 1), _dec(True, 32, 8, 128, 4, 1),
         _dec(True, 16, 8, 128, 4, 1, **_PDL_PF)],
    64: [_dec(True, 16, 8, 128, 4, 1), _dec(True, 32, 16, 128, 4, 1),
         {"PATH": "grouped", "MMA": True, **G_SWEEP[4]}],
    2048: [{"PATH": "grouped", "MMA": True, **g} for g in (G_SWEEP[1], G_SWEEP[3])],
}
QUICK_BUDGET_S = 150.0  # the sweep stops here; a full --quick run takes ~100 s
QUICK_REF_TIMED = 8  # the reference (a host-synced expert loop) is timed up to this T


def quick_configs(t: int, dry: bool = False) -> list[dict]:
    """--quick candidates at T: the list of the largest listed T <= t (dry: the first two)."""
    cands = QUICK_SWEEP[max(b for b in QUICK_SWEEP if b <= max(t, 1))]
    return cands[:2] if dry else list(cands)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "moe_gpu_out")))
    p.add_argument("--dry-run", action="store_true", help="CPU interpreter, tiny shapes.")
    p.add_argument("--tokens", default=None, help="Comma-separated T (default: all).")
    p.add_argument("--sets", type=int, default=4, help="Layers of weights rotated in timing.")
    p.add_argument("--budget-s", type=float, default=270.0, help="Stop sweeping after this.")
    p.add_argument("--compile-tokens", default="1",
                   help="T at which torch.compile(grouped_mm_v2) is timed ('' for none).")
    p.add_argument("--jobs", type=int, default=12, help="Parallel compile workers.")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--quick", action="store_true",
                   help="~100 s: correctness and timing at every T, the reference timed only at "
                        "T <= 8, no torch.compile, a whole-config sweep per T -> best_configs.")
    p.add_argument("--also", default="",
                   help="Further moe_experts variants to check and time, e.g. cute_v2 (its JIT "
                        "compiles count against the time budget).")
    return p.parse_args(argv)


# ---- inputs -----------------------------------------------------------------------------------
def make_weights(dims: dict, device: str, gen: torch.Generator) -> tuple:
    e, h, i = dims["E"], dims["H"], dims["I"]
    gu = torch.empty(e, 2 * i, h, dtype=torch.bfloat16, device=device)
    dn = torch.empty(e, h, i, dtype=torch.bfloat16, device=device)
    gu.normal_(0.0, h**-0.5, generator=gen)
    dn.normal_(0.0, i**-0.5, generator=gen)
    return gu, dn


def make_tokens(t: int, dims: dict, device: str, gen: torch.Generator) -> tuple:
    """x [T,H], weights [T,k] fp32 (renormalised), ids [T,k] skewed and distinct per token."""
    e, k = dims["E"], dims["k"]
    x = torch.empty(t, dims["H"], dtype=torch.bfloat16, device=device).normal_(generator=gen)
    probs = torch.linspace(3.0, 0.2, e, device=device).expand(t, e)
    ids = torch.multinomial(probs, k, replacement=False, generator=gen)
    w = torch.rand(t, k, device=device, generator=gen) + 0.05
    return x, w / w.sum(-1, keepdim=True), ids


def hit_bytes(ids: torch.Tensor, dims: dict) -> int:
    t, k = ids.shape
    hit = int(torch.unique(ids).numel())
    return 2 * (hit * 3 * dims["I"] * dims["H"] + 2 * t * dims["H"]) + 12 * t * k


# ---- correctness ------------------------------------------------------------------------------
def judge(out: torch.Tensor, args: tuple, ref: torch.Tensor, mag: torch.Tensor) -> dict:
    from autoopt.eval.numerics import ulp_diff, ulp_diff_at
    from model.ops import moe_experts as contract

    d = ulp_diff_at(out.cpu(), ref, mag).abs()
    raw = ulp_diff(out.cpu(), ref).abs()
    pol = contract.NUMERICS
    frac = float((d > 0).float().mean())
    ok = int(d.max()) <= pol.max_ulp and frac <= pol.max_mismatch_fraction
    return {"pass": bool(ok), "max_ulp_at_terms": int(d.max()), "mismatch_fraction": frac,
            "max_raw_ulp": int(raw.max()) if raw.max() < (1 << 40) else "nan"}


# ---- compile workers --------------------------------------------------------------------------
_WORKER: dict = {}


def _precompile(job: tuple) -> str:
    """In a worker process: run triton_v1 once at (T, config) on real shapes (fills the cache)."""
    t, cfg, dims = job
    try:
        from model.registry import Registry

        if "run" not in _WORKER:
            _WORKER["run"] = Registry().load_variant("moe_experts", "triton_v1").run
            g = torch.Generator(device="cuda").manual_seed(1)
            _WORKER["w"] = make_weights(dims, "cuda", g)
        g = torch.Generator(device="cuda").manual_seed(t)
        x, w, ids = make_tokens(t, dims, "cuda", g)
        _WORKER["run"](x, *_WORKER["w"], w, ids, SCALE, config=cfg)
        torch.cuda.synchronize()
        return ""
    except Exception as e:  # reported by the timing pass too
        return f"T={t} {cfg}: {type(e).__name__}: {e}"


def precompile(jobs: list[tuple], n: int) -> list[str]:
    import multiprocessing as mp

    with ProcessPoolExecutor(n, mp_context=mp.get_context("spawn")) as pool:
        return [e for e in pool.map(_precompile, jobs) if e]


# ---- timing -----------------------------------------------------------------------------------
class Bench:
    def __init__(self, dims: dict, device: str, sets: int, dry: bool,
                 also: tuple[str, ...] = ()) -> None:
        from model.registry import Registry

        reg = Registry()
        self.dims, self.device, self.dry = dims, device, dry
        self.triton_mod = reg.load_variant("moe_experts", "triton_v1")
        self.triton = self.triton_mod.run
        self.grouped = reg.load_variant("moe_experts", "grouped_mm_v2").run
        self.others: dict = {}  # further registry variants this machine can run (cute_v2)
        self.missing: dict[str, str] = {}
        for name in reg.variants("moe_experts"):
            if name in ("triton_v1", "grouped_mm_v2"):
                continue
            if name not in also:
                self.missing[name] = "not asked for (--also)"
                continue
            if dry:
                self.missing[name] = "not run in the CPU dry run"
                continue
            try:
                self.others[name] = reg.load_variant("moe_experts", name).run
            except Exception as e:  # e.g. nvidia-cutlass-dsl not installed here
                self.missing[name] = f"{type(e).__name__}: {str(e)[:200]}"
        g = torch.Generator(device=device).manual_seed(0)
        self.layers = [make_weights(dims, device, g) for _ in range(1 if dry else sets)]
        self.arg_sets: dict[int, list[tuple]] = {}

    def sets_for(self, t: int) -> list[tuple]:
        """Calls rotating over the layers' weights, each with its own tokens and routing."""
        if t not in self.arg_sets:
            g = torch.Generator(device=self.device).manual_seed(1000 + t)
            calls = max(2 * len(self.layers), 8 if t <= 64 else 2)
            out = []
            for c in range(1 if self.dry else calls):
                x, w, ids = make_tokens(t, self.dims, self.device, g)
                out.append((x, *self.layers[c % len(self.layers)], w, ids, SCALE))
            self.arg_sets[t] = out
        return self.arg_sets[t]

    def time(self, fn, t: int, graph: bool = True, iters: int = 20) -> dict:
        from autoopt.eval import time_callable

        sets = self.sets_for(t)
        try:
            tm = time_callable(fn, sets, device=self.device, warmup=1 if self.dry else 2,
                               iters=1 if self.dry else iters, use_cuda_graph=graph)
        except Exception as e:
            return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        hit = sum(hit_bytes(s[4], self.dims) for s in sets) / len(sets)
        return {"us": tm.median_us, "iqr_us": tm.iqr_us, "method": tm.method,
                "hit_bytes": hit, "notes": list(tm.notes)}


def kernels_per_call(fn, args: tuple) -> int | None:
    if not args[0].is_cuda:
        return None
    from torch.profiler import ProfilerActivity, profile

    fn(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def compiled_grouped(run):
    import torch._inductor.config as inductor_config

    inductor_config.emulate_precision_casts = True  # keep the BF16 rounding points
    return torch.compile(run, dynamic=False)


# ---- the run ----------------------------------------------------------------------------------
def sweep_configs(t: int, k: int, dry: bool = False) -> dict[str, list[dict]]:
    """Configs per stage at T: kernel A (at B_SWEEP[0]), kernel B, grouped (dry: one or two
    of each, every stage, to check the logic)."""
    a_sweep, b_sweep, g_sweep = (A_SWEEP[3:4], B_SWEEP[4:5], G_SWEEP[-1:]) if dry else (
        A_SWEEP, B_SWEEP, G_SWEEP)
    out: dict[str, list[dict]] = {"A": [], "B": [], "G": []}
    if t * k <= 1024:
        out["A"] = [{"PATH": "decode", **B_SWEEP[0], **a} for a in a_sweep]
        out["B"] = [{"PATH": "decode", **A_SWEEP[0], **b} for b in b_sweep]
    if t >= 16 or dry:
        out["G"] = [{"PATH": "grouped", "MMA": True, **g} for g in g_sweep]
    return out


def run_sweep(bench: Bench, t: int, check: tuple, deadline: float) -> list[dict]:
    rows: list[dict] = []
    plan = sweep_configs(t, bench.dims["k"], bench.dry)
    best_a: dict = {}
    for stage in ("A", "B", "G"):
        for cfg in plan[stage]:
            if time.monotonic() > deadline:
                return rows + [{"stage": stage, "skipped": "time budget spent"}]
            if stage == "B" and best_a:
                cfg = {**cfg, **best_a}
            rows.append({"stage": stage, "config": cfg, **bench.time(
                lambda *a, c=cfg: bench.triton(*a, config=c), t),
                "correct": judge(bench.triton(*check[0], config=cfg), *check)})
        done = [r for r in rows if r.get("stage") == stage and "us" in r and r["correct"]["pass"]]
        if stage == "A" and done:
            best = min(done, key=lambda r: r["us"])["config"]
            best_a = {key: best[key] for key in A_SWEEP[0]}
    return rows


def run_quick(bench: Bench, t: int, check: tuple, deadline: float) -> list[dict]:
    """Whole configs at T, each checked against the reference and timed (stage Q)."""
    rows: list[dict] = []
    for cfg in quick_configs(t, bench.dry):
        if time.monotonic() > deadline:
            return rows + [{"stage": "Q", "skipped": "time budget spent"}]
        try:  # a config that cannot run here (e.g. PDL on an older driver) is reported
            correct = judge(bench.triton(*check[0], config=cfg), *check)
        except Exception as e:
            rows.append({"stage": "Q", "config": cfg, "error": f"{type(e).__name__}: {e}"[:300],
                         "correct": {"pass": False}})
            continue
        rows.append({"stage": "Q", "config": cfg, "correct": correct, **bench.time(
            lambda *a, c=cfg: bench.triton(*a, config=c), t)})
    return rows


def resolved_default(bench: Bench, t: int) -> dict:
    """The config triton_v1 runs at T when given none (its bucket defaults)."""
    return bench.triton_mod._config(t, t * bench.dims["k"], None, bench.device != "cpu")


def best_of(rows: list[dict]) -> dict | None:
    ok = [r for r in rows if "us" in r and r.get("correct", {}).get("pass")]
    return min(ok, key=lambda r: r["us"]) if ok else None


def measure_t(bench: Bench, t: int, args: argparse.Namespace, deadline: float) -> dict:
    from model.ops import moe_experts as contract

    g = torch.Generator(device=bench.device).manual_seed(t)
    x, w, ids = make_tokens(t, bench.dims, bench.device, g)
    cargs = (x, *bench.layers[0], w, ids, SCALE)
    ref, mag = contract.reference(*cargs).cpu(), contract.combine_magnitude(*cargs).cpu()
    check = (cargs, ref, mag)
    variants = {"triton_v1": bench.triton, "grouped_mm_v2": bench.grouped, **bench.others}
    row: dict = {"correct": {}, "time": {}}
    if not args.quick or t <= QUICK_REF_TIMED:
        row["time"]["reference"] = bench.time(contract.reference, t, graph=False, iters=4)
    else:
        row["time"]["reference"] = {"skipped": "--quick", "hit_bytes": sum(
            hit_bytes(c[4], bench.dims) for c in bench.sets_for(t)) / len(bench.sets_for(t))}
    for name, fn in variants.items():
        try:
            row["correct"][name] = judge(fn(*cargs), *check)
        except Exception as e:  # a variant that cannot run this shape is reported, not fatal
            row["correct"][name] = {"pass": False, "error": f"{type(e).__name__}: {e}"[:300]}
            continue
        row["time"][name] = bench.time(fn, t)
    row["kernels"] = {name: kernels_per_call(fn, cargs) for name, fn in (
        ("reference", contract.reference), *variants.items())
        if "us" in row["time"].get(name, {})}
    if args.quick and not args.no_sweep:
        row["sweep"] = run_quick(bench, t, check, deadline)
        if "us" in row["time"].get("triton_v1", {}):  # the default competes too
            row["sweep"].insert(0, {"stage": "default", "config": resolved_default(bench, t),
                                    **row["time"]["triton_v1"],
                                    "correct": row["correct"]["triton_v1"]})
    elif not args.no_sweep:
        row["sweep"] = run_sweep(bench, t, check, deadline)
        best = best_of(row["sweep"])
        if best:
            row["time"]["triton_v1 best"] = {k: v for k, v in best.items() if k != "stage"}
            row["kernels"]["triton_v1 best"] = kernels_per_call(
                lambda *a: bench.triton(*a, config=best["config"]), cargs)
    return row


COMPILE_S = 60.0  # what one torch.compile of grouped_mm_v2 may take (each new shape recompiles)


def add_compile(bench: Bench, results: dict, tokens: list[int], deadline: float) -> None:
    fn = compiled_grouped(bench.grouped)
    for t in tokens:
        if time.monotonic() + COMPILE_S > deadline:
            results["tokens"][t]["time"]["compile(grouped_mm_v2)"] = {"skipped": "time budget"}
            continue
        results["tokens"][t]["time"]["compile(grouped_mm_v2)"] = bench.time(fn, t)


def pct(entry: dict, bw: float) -> tuple[str, str, str]:
    if "us" not in entry:
        return "-", "-", "-"
    gbs = entry["hit_bytes"] / (entry["us"] * 1e-6) / 1e9
    return f"{entry['us']:.1f}", f"{gbs:.0f}", f"{100 * gbs * 1e9 / bw:.0f}%"


def tables(results: dict) -> tuple[str, str]:
    bw = results["ceilings"]["copy_bytes_s"]
    impls = ("reference", "grouped_mm_v2", "compile(grouped_mm_v2)", *sorted(
        {n for r in results["tokens"].values() for n in r["time"]} - {
            "reference", "grouped_mm_v2", "compile(grouped_mm_v2)", "triton_v1",
            "triton_v1 best"}), "triton_v1", "triton_v1 best")
    lines = [f"# moe_experts on {results['gpu']} (copy ceiling {bw / 1e12:.2f} TB/s)", "",
             "| T | impl | us | GB/s (hit bytes) | % of floor | kernels | correct |",
             "|---|---|---|---|---|---|---|"]
    short = ["T     hitMB  floor_us  ref_us  gmm_us  compile  tri_us  best_us  %floor  kernels"]
    for t, row in results["tokens"].items():
        tm = row["time"]
        for name in impls:
            if name not in tm:
                continue
            us, gbs, p = pct(tm[name], bw)
            ok = row["correct"].get(name.split(" ")[0], {}).get("pass", "")
            if name == "triton_v1 best":
                ok = tm[name].get("correct", {}).get("pass", "")
            lines.append(f"| {t} | {name} | {us} | {gbs} | {p} | "
                         f"{row['kernels'].get(name, '')} | {ok} |")
        best = tm.get("triton_v1 best", tm.get("triton_v1", {}))
        hit = tm["reference"].get("hit_bytes", 0)
        short.append(f"{t:<5} {hit / 1e6:6.1f} {hit / bw * 1e6:9.1f} "
                     f"{pct(tm['reference'], bw)[0]:>7} "
                     f"{pct(tm.get('grouped_mm_v2', {}), bw)[0]:>7} "
                     f"{pct(tm.get('compile(grouped_mm_v2)', {}), bw)[0]:>8} "
                     f"{pct(tm.get('triton_v1', {}), bw)[0]:>7} {pct(best, bw)[0]:>8} "
                     f"{pct(best, bw)[2]:>7} {row['kernels'].get('triton_v1', '-')!s:>8}")
    if results.get("best_configs"):
        lines += ["", "## best triton_v1 config per T", "", "```json",
                  json.dumps(results["best_configs"], indent=1), "```"]
    for t, row in results["tokens"].items():
        if row.get("sweep"):
            lines += ["", f"## sweep T={t}", "", "| stage | us | correct | config |",
                      "|---|---|---|---|"]
            for r in row["sweep"]:
                lines.append(f"| {r['stage']} | {pct(r, bw)[0]} | "
                             f"{r.get('correct', {}).get('pass', '')} | "
                             f"{json.dumps(r.get('config', r.get('skipped')))} |")
    return "\n".join(lines) + "\n", "\n".join(short)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    device = "cpu" if args.dry_run else "cuda"
    dims = DRY if args.dry_run else RANK
    tokens = [int(x) for x in args.tokens.split(",")] if args.tokens else list(
        DRY_TOKENS if args.dry_run else TOKENS)
    from dataclasses import asdict

    from autoopt.eval import measure_ceilings

    ceil = measure_ceilings(device, refresh=True)
    results = {"gpu": ceil.gpu, "torch": torch.__version__, "ceilings": asdict(ceil),
               "dims": dims, "scale": SCALE, "sets": args.sets, "tokens": {}}
    bench = Bench(dims, device, args.sets, args.dry_run,
                  tuple(x for x in args.also.split(",") if x))
    results["variants_not_run"] = bench.missing
    if not args.dry_run and not args.no_sweep:
        plan = {t: quick_configs(t) if args.quick else [
            c for stage in sweep_configs(t, dims["k"]).values() for c in stage] for t in tokens}
        jobs = [(t, cfg, dims) for t in tokens for cfg in plan[t]] + [
            (t, None, dims) for t in tokens]
        results["compile_errors"] = precompile(jobs, args.jobs)
    results["precompile_s"] = time.monotonic() - start
    # The sweep stops early enough to leave room for the torch.compile baselines.
    compile_t = [int(x) for x in args.compile_tokens.split(",") if x.strip() and
                 int(x) in tokens and not args.dry_run and not args.quick]
    deadline = start + (min(args.budget_s, QUICK_BUDGET_S) if args.quick else args.budget_s)
    for t in tokens:
        results["tokens"][t] = measure_t(bench, t, args,
                                         deadline - COMPILE_S * (len(compile_t) + 0.5))
    add_compile(bench, results, compile_t, deadline)
    results["best_configs"] = {f"T={t}": best["config"] for t, row in results["tokens"].items()
                               if (best := best_of(row.get("sweep", [])))}
    results["elapsed_s"] = time.monotonic() - start
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    md, short = tables(results)
    (args.out / "results.md").write_text(md)
    print(short)
    correct = all(c["pass"] for r in results["tokens"].values() for c in r["correct"].values())
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())
