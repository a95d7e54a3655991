"""The FP32 router (triton_v1) and the CuTe DSL grouped-GEMM experts (cute_v2) on one GPU.

On the H200 (about 3 minutes; every section stops at the --budget-s deadline and says so):
    python benchmarks/router_cute_gpu.py --out $OUT
Router only, about 60-90 s (mostly Triton compiles): `--focus` (implies --skip-moe, budget 75 s).
Router: triton_v1 against the reference at the Beam-1.0 TP8 rank shapes (H=5120, E=256, 8 groups,
top-4 groups, top-8) for T = 1, 2, 4, 8, 16, 32, 64, 2048: ids exact except FP32 ties (seeds
0-2), weights judged by the op's policy, time per call under CUDA graphs over rotating weight
sets (together > 2x L2, so the 5.2 MB weight comes from HBM), % of the floor at the bandwidth
ceiling measured in this process, and kernels per call (torch.profiler). Each T then times a
short list of candidate configs (each checked against the reference on one seed first) and
the JSON's `best_configs` holds the fastest passing one per T, complete, as {"T=1": {...}}.
Experts: when nvidia-cutlass-dsl imports, moe_experts cute_v2 against the reference and the
capture-safe grouped_mm path at T = 64, 256, 2048 (E=256, H=5120, I=320, k=8): policy,
time, kernels per call.
Writes $OUT/router_cute.json and $OUT/router_cute.md and prints the table last. Exit 0 when
everything that ran passed its policy; a case that raises is a failed row with its traceback.
nvidia-cutlass-dsl installed with `pip install --target DIR` needs
PYTHONPATH=DIR:DIR/nvidia_cutlass_dsl/dsl_packages (its .pth file is not read from a target dir).

`--dry-run` runs the same code on CPU with small widths (Triton interpreter; the CuTe GEMM
replaced by a torch stand-in; timings not meaningful).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

ROUTER_TOKENS = (1, 2, 4, 8, 16, 32, 64, 2048)
# Candidates next to each T's default (overrides of `default_config(T)`; the defaults were chosen
# without a GPU). Each is checked on one seed before it is timed; the fastest passing one (the
# default included) is the T's best config.
SWEEP = {
    1: [{"BLOCK_E": 4}, {"BLOCK_E": 16}, {"SPLIT_K": 10, "BLOCK_K": 128},
        {"BLOCK_E": 2, "BLOCK_K": 512, "SPLIT_K": 4, "num_warps": 2}, {"FUSE": 0}],
    2: [{"BLOCK_E": 4}, {"FUSE": 0}, {"SEL_T": 1}],
    4: [{"FUSE": 1, "SEL_T": 4}, {"FUSE": 1, "SEL_T": 1},
        {"BLOCK_K": 256, "num_warps": 2, "SPLIT_K": 20}],
    8: [{"FUSE": 1, "SEL_T": 2}, {"FUSE": 1, "SEL_T": 8}, {"BLOCK_E": 4, "BLOCK_K": 128,
                                                          "num_warps": 2},
        {"SPLIT_K": 10, "BLOCK_K": 128}, {"BLOCK_E": 16, "BLOCK_K": 32}],
    16: [{"LIB_GEMM": 1}, {"BLOCK_E": 16, "BLOCK_K": 32, "SPLIT_K": 20}],
    32: [{"LIB_GEMM": 1}, {"BLOCK_E": 16, "BLOCK_K": 32, "SPLIT_K": 20}],
    64: [{"LIB_GEMM": 1}, {"BLOCK_E": 16, "BLOCK_K": 32, "SPLIT_K": 20}],
    2048: [{"LIB_GEMM": 0}, {"LIB_GEMM": 0, "SPLIT_K": 4, "BLOCK_E": 32, "num_warps": 8}],
}
DRY_SWEEP = {1: [{"FUSE": 0}], 5: [{"FUSE": 1, "SEL_T": 8}]}
MOE_TOKENS = (64, 256, 2048)
DRY_ROUTER = {"H": 320, "E": 256, "n_group": 8, "topk_group": 4, "top_k": 8}
DRY_MOE = {"H": 64, "E": 16, "I": 32, "k": 8}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "router_cute_out")))
    p.add_argument("--dry-run", action="store_true", help="CPU, small widths: check the logic.")
    p.add_argument("--budget-s", type=float, default=220.0, help="Stop starting cases after this.")
    p.add_argument("--skip-moe", action="store_true")
    p.add_argument("--focus", action="store_true",
                   help="router only (correctness, timing, per-T sweep) in about a minute")
    args = p.parse_args(argv)
    if args.focus:
        args.skip_moe = True
        if args.budget_s == p.get_default("budget_s"):
            args.budget_s = 75.0
    return args


def guarded(label: dict, fn: Callable, *args) -> dict:
    """One case's row; an exception becomes a failed row (the rest of the run still happens)."""
    try:
        return fn(*args)
    except Exception as exc:  # a GPU-only failure must not cost the other cases' numbers
        tb = traceback.format_exc().strip().splitlines()[-12:]
        return {**label, "passed": False, "reasons": [f"{type(exc).__name__}: {exc}"[:2000]],
                "traceback": tb, "variant_us": None}


def load_file(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def kernels_per_call(fn: Callable, args: tuple, device: str) -> int | None:
    """CUDA kernels one call launches (after a warm-up call), from torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if not device.startswith("cuda"):
        return None
    fn(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def judge_router(c, args: tuple, got: tuple, ref: tuple, stats, ties: list) -> list[str]:
    import torch

    from autoopt.eval.numerics import router_tie_rows

    cpu = tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)
    ok, rows = router_tie_rows(cpu, ref[1].cpu(), got[1].cpu())
    ties.extend(r for r in rows if r["tie"])
    bad = [r for r in rows if not r["tie"]]
    stats.add(got[0].cpu(), ref[0].cpu(), (~ok)[:, None].expand_as(ref[1]))
    return [f"ids differ without an FP32 tie in {len(bad)} rows, e.g. {bad[0]}"] if bad else []


def check_config(c, mod, shape: dict, cfg: dict, device: str) -> list[str]:
    """The policy on one seed for one config (ids modulo ties, weights by the op's policy)."""
    import torch

    from autoopt.eval.numerics import OutputStats, effective_policy, judge

    stats, ties = OutputStats(), []
    with torch.no_grad():
        args = c.make_inputs(shape, 0, device)
        reasons = judge_router(c, args, mod.run(*args, config=cfg), c.reference(*args), stats,
                               ties)
    return reasons + judge(effective_policy(c.numerics, torch.float32, device), stats, "weights")


def sweep_configs(c, mod, t: int, shape: dict, sets, device: str, candidates: list[dict],
                  deadline: float) -> list[dict]:
    """Each candidate: checked, then timed if it passed; stops at the deadline."""
    from autoopt.eval.timing import time_callable

    out = []
    for over in candidates:
        cfg = {**mod.default_config(t), **over}
        if time.monotonic() > deadline:
            out.append({"config": over, "us": None, "passed": None, "reasons": ["time budget"]})
            continue
        try:
            reasons = check_config(c, mod, shape, cfg, device)
            run = lambda *a, cfg=cfg: mod.run(*a, config=cfg)  # noqa: E731
            us = None if reasons else time_callable(run, sets, device=device,
                                                    iters=5 if device == "cpu" else 30).median_us
        except Exception as exc:  # one bad candidate must not cost the others
            reasons, us = [f"{type(exc).__name__}: {exc}"[:500]], None
        out.append({"config": over, "full": cfg, "us": us, "passed": not reasons,
                    "reasons": reasons})
    return out


def router_case(mod, t: int, device: str, ceilings, dry: bool, deadline: float = math.inf,
                ) -> dict:
    import torch

    from autoopt.eval.numerics import OutputStats, effective_policy, judge
    from autoopt.eval.timing import floor_us, time_callable
    from model.config import preset
    from model.ops import CONTRACTS

    c = CONTRACTS["router"]
    cfg = preset("beam-1.0-501b")
    shape = {"T": t, **DRY_ROUTER} if dry else dict(c.shapes_for(cfg, t, cfg.shard(8)))
    stats, ties, reasons = OutputStats(), [], []
    with torch.no_grad():
        for seed in (0,) if dry else (0, 1, 2):
            args = c.make_inputs(shape, seed, device)
            reasons += judge_router(c, args, mod.run(*args), c.reference(*args), stats, ties)
    reasons += judge(effective_policy(c.numerics, torch.float32, device), stats, "weights")
    sets = lambda n: [c.make_inputs(shape, 100 + i, device) for i in range(n)]  # noqa: E731
    tv = time_callable(mod.run, sets, device=device, iters=5 if dry else 50)
    tr = time_callable(c.reference, sets, device=device, iters=5 if dry else 50)
    floor = floor_us(c, shape, ceilings) if ceilings else None
    one = c.make_inputs(shape, 7, device)
    sweep = sweep_configs(c, mod, t, shape, sets, device, (DRY_SWEEP if dry else SWEEP).get(t, []),
                          deadline)
    best = min(([] if reasons else [(tv.median_us, mod.default_config(t))])
               + [(x["us"], x["full"]) for x in sweep if x["passed"] and x["us"]],
               key=lambda p: p[0], default=(None, None))
    return {"op": "router", "variant": "triton_v1", "T": t, "shape": shape,
            "passed": not reasons, "reasons": reasons, "tie_rows": len(ties),
            "weights": stats.to_dict(), "variant_us": tv.median_us, "variant_iqr_us": tv.iqr_us,
            "reference_us": tr.median_us, "speedup": tr.median_us / tv.median_us,
            "floor_us": floor, "pct_of_floor": 100 * floor / tv.median_us if floor else None,
            "x_floor": tv.median_us / floor if floor else None, "method": tv.method,
            "kernels": kernels_per_call(mod.run, one, device),
            "reference_kernels": kernels_per_call(c.reference, one, device),
            "default_config": mod.default_config(t), "sweep": sweep,
            "best_us": best[0], "best_config": best[1]}


def moe_impls(device: str) -> tuple[dict[str, Callable], str | None]:
    """name -> callable for the experts; the reason cute_v2 is absent, if it is."""
    from model.registry import Registry

    impls: dict[str, Callable] = {}
    why = None
    try:
        cute = load_file(REPO / "kernels" / "moe_experts" / "cute_v2.py", "moe_cute_v2")
    except ImportError as exc:
        cute, why = None, f"nvidia-cutlass-dsl does not import here ({exc})"
    if cute is not None and device.startswith("cuda"):
        impls["cute_v2"] = cute.run
    elif cute is not None:  # CPU dry run: the same host code around a torch stand-in GEMM
        impls["cute_v2 (torch GEMM stand-in)"] = lambda *a: cute.moe_experts_fwd(
            *a[:6], 0, 64, 128, _stand_in_gemm)
    if device.startswith("cuda"):
        impls["grouped_mm"] = Registry().load_variant("moe_experts", "grouped_mm_v1").run
    return impls, why


def _stand_in_gemm(a, w, tiles, bm, bn):
    import torch
    import torch.nn.functional as F

    out = torch.zeros((a.shape[0], w.shape[1]), dtype=a.dtype, device=a.device)
    for i, e in enumerate(tiles.tolist()):
        if e >= 0:
            out[i * bm:(i + 1) * bm] = F.linear(a[i * bm:(i + 1) * bm], w[e])
    return out


def moe_case(name: str, fn: Callable, t: int, device: str, ceilings, dry: bool) -> dict:
    import torch

    from autoopt.eval.numerics import OutputStats, effective_policy, judge
    from autoopt.eval.timing import floor_us, time_callable
    from model.config import preset
    from model.ops import CONTRACTS

    c = CONTRACTS["moe_experts"]
    cfg = preset("beam-1.0-501b")
    shape = {"T": t, **DRY_MOE} if dry else dict(c.shapes_for(cfg, t, cfg.shard(8)))
    stats = OutputStats()
    with torch.no_grad():
        args = c.make_inputs(shape, 0, device)
        stats.add(fn(*args).cpu(), c.reference(*args).cpu())
    reasons = judge(effective_policy(c.numerics, torch.bfloat16, device), stats, "out")
    iters = 3 if dry else 20
    tv = time_callable(fn, [args], device=device, warmup=3, iters=iters)
    row = {"op": "moe_experts", "variant": name, "T": t, "shape": shape, "passed": not reasons,
           "reasons": reasons, "out": stats.to_dict(), "variant_us": tv.median_us,
           "method": tv.method, "kernels": kernels_per_call(fn, args, device)}
    floor = floor_us(c, shape, ceilings) if ceilings else None
    row.update(floor_us=floor, pct_of_floor=100 * floor / tv.median_us if floor else None)
    return row


def reference_moe(t: int, device: str, dry: bool) -> dict:
    from autoopt.eval.timing import time_callable
    from model.config import preset
    from model.ops import CONTRACTS

    c = CONTRACTS["moe_experts"]
    cfg = preset("beam-1.0-501b")
    shape = {"T": t, **DRY_MOE} if dry else dict(c.shapes_for(cfg, t, cfg.shard(8)))
    args = c.make_inputs(shape, 0, device)
    tr = time_callable(c.reference, [args], device=device, warmup=2, iters=3 if dry else 10)
    return {"op": "moe_experts", "variant": "reference", "T": t, "passed": True, "reasons": [],
            "variant_us": tr.median_us, "method": tr.method,
            "kernels": kernels_per_call(c.reference, args, device)}


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each experts row gets the reference's time and its speed-up over it and grouped_mm."""
    by = {r["variant"]: r["variant_us"] for r in rows if r.get("variant_us")}
    for r in rows:
        if not r.get("variant_us"):
            continue
        if "reference" in by and r["variant"] != "reference":
            r.update(reference_us=by["reference"], speedup=by["reference"] / r["variant_us"])
        if "grouped_mm" in by and r["variant"] != "grouped_mm":
            r["x_grouped_mm"] = by["grouped_mm"] / r["variant_us"]
    return rows


def _us(v) -> str:
    return f"{v:.2f} us" if v is not None else "-"


def markdown(rows: list[dict], meta: dict) -> str:
    out = [f"# router triton_v1 and moe_experts cute_v2 ({meta['gpu']})", "",
           f"Bandwidth ceiling {meta['copy_tb_s']} TB/s measured in this run; "
           f"{meta['note']}", "",
           "| op | variant | T | pass | us | ref us | x ref | x grouped_mm | floor us | % floor "
           "| kernels | ref kernels | ties |", "|" + "---|" * 13]
    for r in rows:
        f = lambda k, fmt="{:.2f}": fmt.format(r[k]) if r.get(k) is not None else "-"  # noqa
        out.append(f"| {r['op']} | {r['variant']} | {r['T']} | {'yes' if r['passed'] else 'NO'} "
                   f"| {f('variant_us')} | {f('reference_us')} | {f('speedup')} "
                   f"| {f('x_grouped_mm')} "
                   f"| {f('floor_us')} | {f('pct_of_floor', '{:.0f}')} | {f('kernels', '{}')} "
                   f"| {f('reference_kernels', '{}')} | {f('tie_rows', '{}')} |")
    failed = [f"- {r['op']} {r['variant']} T={r['T']}: {'; '.join(r['reasons'])}"
              for r in rows if not r["passed"]]
    sweeps = [f"- router T={r['T']}: default {_us(r['variant_us'])}; "
              + "; ".join(f"{json.dumps(x['config'])} "
                          + (_us(x["us"]) if x["passed"] else f"FAIL {x['reasons'][:1]}")
                          for x in r["sweep"])
              + f"; best {_us(r.get('best_us'))}"
              for r in rows if r.get("sweep")]
    return "\n".join(out + ([""] + failed if failed else []) + ([""] + sweeps if sweeps else [])
                     ) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from autoopt.eval.timing import measure_ceilings

    device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    dry = device == "cpu"
    deadline = time.monotonic() + args.budget_s
    ceilings = measure_ceilings(device, refresh=True) if not dry else None
    router = load_file(REPO / "kernels" / "router" / "triton_v1.py", "router_triton_v1")
    rows: list[dict] = []
    skipped: list[str] = []
    for t in (1, 5) if dry else ROUTER_TOKENS:
        if time.monotonic() > deadline:
            skipped.append(f"router T={t}: time budget")
            continue
        rows.append(guarded({"op": "router", "variant": "triton_v1", "T": t}, router_case,
                            router, t, device, ceilings, dry, deadline))
    moe_note = "experts skipped (--skip-moe)"
    if not args.skip_moe:
        impls, why = moe_impls(device)
        moe_note = why or (f"experts: {', '.join(impls)} against the reference"
                           + (" (torch stand-in for the CuTe GEMM on CPU)" if dry else ""))
        for t in (1, 3) if dry else MOE_TOKENS:
            got = []
            for name, fn in impls.items():
                if time.monotonic() > deadline:
                    skipped.append(f"moe_experts {name} T={t}: time budget")
                    continue
                got.append(guarded({"op": "moe_experts", "variant": name, "T": t}, moe_case,
                                   name, fn, t, device, ceilings, dry))
            if time.monotonic() <= deadline and impls:
                got.append(guarded({"op": "moe_experts", "variant": "reference", "T": t},
                                   reference_moe, t, device, dry))
            rows += with_ratios(got)
    gpu = torch.cuda.get_device_name() if not dry else "cpu (dry run: not meaningful)"
    meta = {"gpu": gpu, "copy_tb_s": round(ceilings.copy_bytes_s / 1e12, 2) if ceilings else None,
            "note": moe_note, "skipped": skipped, "torch": torch.__version__}
    args.out.mkdir(parents=True, exist_ok=True)
    best = {f"T={r['T']}": r["best_config"] for r in rows
            if r["op"] == "router" and r.get("best_config")}
    best_us = {f"T={r['T']}": r["best_us"] for r in rows
               if r["op"] == "router" and r.get("best_config")}
    (args.out / "router_cute.json").write_text(json.dumps(
        {"meta": meta, "rows": rows, "best_configs": best, "best_us": best_us},
        indent=1, default=str))
    md = markdown(rows, meta)
    (args.out / "router_cute.md").write_text(md)
    print("\n".join(skipped))
    print(md)
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
