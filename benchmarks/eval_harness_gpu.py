"""The judge on a GPU: every corpus variant and every registry variant judged, one verdict table.

    python benchmarks/eval_harness_gpu.py --out DIR --part corpus   # on the H200, ~6 minutes
    python benchmarks/eval_harness_gpu.py --out DIR --part registry # ~6 minutes (5 at once)
    python benchmarks/eval_harness_gpu.py --out DIR2 --heavy --only moe_experts/cute_v2 \
        --jobs 1 --timeout 540                                      # the heavy op, alone
    python benchmarks/eval_harness_gpu.py --out DIR --dry-run       # on CPU: a few variants
    python -m pytest -q -m gpu tests/test_eval_gpu.py               # the same facts, as assertions

Each variant is verified by `autoopt.eval.verify_variant` on cuda at the target's real widths
(default h200-tp8-decode; its buckets plus drawn, long and edge-case shapes, secret seeds), with
compute-sanitizer's racecheck for Triton and CuTe variants that pass everything else, several
verifications at once (each in its own process: a judge and its worker). The corpus
(tests/adversarial) must be rejected, its honest variants and every kernels/<op>/*.py must pass.
Writes under --out:
    verdicts.json   one entry per variant: expected and actual verdict, reasons, races, floor,
                    elapsed, the run's secret (to reproduce it with `autoopt verify --secret`)
    verdicts.md     the same as a table, with the GPU, torch and triton versions
    ceilings.json   the copy bandwidth and matmul rates the floors divide by (measured first)
    bench_swiglu.json  (unless --no-bench) the honest Triton swiglu timed in its worker against
                    the reference and torch.compile, and a cached cheat's timing voided
and prints a short table last. Exit code 0 when every verdict is the expected one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # a plain checkout works too (no `pip install -e .` needed)

DRY_RUN_ITEMS = ("honest_triton_swiglu", "reused_buffer_torch", "race_write_write_triton",
                 "reach_torch_sys")
# Ops whose inputs at the target's widths are gigabytes (moe_experts at TP8: ~2.5 GB of expert
# weights per input set): verified only with --heavy, alone (see the module docstring).
HEAVY_OPS = ("moe_experts",)


def plan_items(only: list[str] | None) -> list[dict]:
    """(variant, op, path, expected) for the corpus and the registry."""
    from tests.test_eval_adversarial import CORPUS, CPU_UNCHECKED, PASSING, REJECTED

    items = [{"name": s, "op": spec[0], "path": str(CORPUS / f"{s}.py"), "expected": "reject",
              "kind": "corpus"} for s, spec in REJECTED.items()]
    items += [{"name": s, "op": op, "path": str(CORPUS / f"{s}.py"), "expected": "reject",
               "kind": "corpus (a race torch leaves undefined; shows only as it happens)"}
              for s, op in CPU_UNCHECKED.items()]
    items += [{"name": s, "op": op, "path": str(CORPUS / f"{s}.py"), "expected": "pass",
               "kind": "corpus (honest)"} for s, op in PASSING.items()]
    for path in sorted((REPO / "kernels").glob("*/*.py")):
        # A variant its record rejects for good (one that implements a former contract) is
        # expected to fail; every other registry variant must pass.
        record = path.parent / "records" / f"{path.stem}.json"
        status = json.loads(record.read_text()).get("status") if record.is_file() else None
        items.append({"name": f"{path.parent.name}/{path.stem}", "op": path.parent.name,
                      "path": str(path), "expected": "reject" if status == "rejected" else "pass",
                      "kind": "registry (rejected in its record)" if status == "rejected"
                      else "registry"})
    if only:
        items = [i for i in items if i["name"] in only]
    return items


def _skipped(item: dict, why: str) -> dict:
    return {**item, "verdict": "skipped", "as_expected": None, "reasons": [why], "races": None,
            "floor": None, "calls": None, "secret": "", "env": {}, "elapsed_s": 0.0}


def _init_worker(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)  # several judges share the CPU cores


def judge_one(item: dict, device: str, target: str | None, seeds: int, max_tokens: int | None,
              timeout_s: float, memcheck: bool = False) -> dict:
    from autoopt.eval.plan import Budget
    from autoopt.eval.verify import verify_variant

    start = time.monotonic()
    budget = Budget(seeds=seeds, max_tokens=max_tokens)
    timeout = min(timeout_s, 60.0) if item["name"] == "hangs" else timeout_s
    try:
        rep = verify_variant(item["op"], Path(item["path"]), device=device, target=target,
                             budget=budget, timeout_s=timeout, memcheck=memcheck)
        verdict, reasons, checks = rep.verdict, rep.reasons, rep.checks
        secret, env = rep.secret, rep.env
    except Exception as e:  # noqa: BLE001 - a harness failure is a row, never the end of the run
        verdict, reasons, checks, secret, env = "error", [f"{type(e).__name__}: {e}"], {}, "", {}
    return {**item, "verdict": verdict, "as_expected": verdict == item["expected"],
            "reasons": reasons, "races": checks.get("races", {}).get("status"),
            "memcheck": checks.get("memcheck", {}).get("status"),
            "floor": checks.get("floor"), "calls": checks.get("behaviour", {}).get("calls"),
            "secret": secret, "env": env, "elapsed_s": round(time.monotonic() - start, 1)}


def run_all(items: list[dict], args: argparse.Namespace, device: str) -> list[dict]:
    """Verify every item, several at once; stop starting new ones after --budget-s (those are
    reported "not run"). Partial results are written as they come, so a killed run leaves them."""
    results: list[dict] = []
    start = time.monotonic()
    # Registry kernels first: they are the slowest (Triton compile, racecheck) and must pass.
    order = sorted(items, key=lambda i: (i["kind"] != "registry", i["name"]))
    ctx = get_context("spawn")  # each judge gets its own CUDA context
    threads = max(1, (os.cpu_count() or 2) // max(args.jobs, 1))
    with ProcessPoolExecutor(args.jobs, mp_context=ctx, initializer=_init_worker,
                             initargs=(threads,)) as pool:
        futures = {pool.submit(judge_one, i, device, args.target, args.seeds, args.max_tokens,
                               args.timeout, args.memcheck): i for i in order}
        for f in as_completed(futures):
            r = f.result() if not f.cancelled() else None
            if r is None:
                continue
            results.append(r)
            mark = "ok " if r["as_expected"] else "BAD"
            print(f"{mark} {r['verdict']:6s} {r['elapsed_s']:6.1f}s {r['name']}", flush=True)
            (args.out / "partial.json").write_text(json.dumps(results, indent=1, default=str))
            if time.monotonic() - start > args.budget_s:
                for g in futures:
                    g.cancel()
        for g, item in futures.items():
            if g.cancelled():
                results.append({**item, "verdict": "not run", "as_expected": False,
                                "reasons": ["time budget spent"], "races": None, "floor": None,
                                "calls": None, "secret": "", "env": {}, "elapsed_s": 0.0})
    return sorted(results, key=lambda r: (r["kind"], r["name"]))


def write_tables(out: Path, results: list[dict], device: str, wall_s: float) -> list[str]:
    from autoopt.eval.verify import run_env

    env = next((r["env"] for r in results if r.get("env")), None) or run_env(device)
    bad = [r for r in results if r["as_expected"] is False]
    head = (f"# Judge verdicts on {env.get('gpu') or device}\n\ntorch {env.get('torch')}, triton "
            f"{env.get('triton')}; {len(results)} variants in {wall_s:.0f} s; "
            f"{len(results) - len(bad)} as expected, {len(bad)} not.\n")
    rows = ["| variant | op | kind | expected | verdict | races | first reason |",
            "|---|---|---|---|---|---|---|"]
    for r in results:
        reason = (r["reasons"][0] if r["reasons"] else "").replace("|", "/")[:140]
        rows.append(f"| {r['name']} | {r['op']} | {r['kind']} | {r['expected']} | "
                    f"{r['verdict']}{' (!)' if r['as_expected'] is False else ''} | "
                    f"{r['races'] or '-'} "
                    f"| {reason} |")
    (out / "verdicts.md").write_text(head + "\n" + "\n".join(rows) + "\n")
    (out / "verdicts.json").write_text(json.dumps(
        {"device": device, "env": env, "wall_s": wall_s, "results": results}, indent=2,
        default=str))
    lines = [f"{r['name']:44s} {r['expected']:6s} -> {r['verdict']:7s} "
             f"{'UNEXPECTED' if r['as_expected'] is False else ''}" for r in results]
    return lines + [head.splitlines()[-1]]


def bench(out: Path, device: str, lines: list[str]) -> None:
    from autoopt.eval.shapes import gpu_shapes
    from autoopt.eval.timing import bench_op

    corpus = REPO / "tests" / "adversarial"
    tokens = (1, 8, 32, 128) if device == "cuda" else (1, 3)
    shapes = gpu_shapes("swiglu", tokens)[::2] if device == "cuda" else [
        {"T": t, "I": 64} for t in tokens]
    rows = bench_op("swiglu", corpus / "honest_triton_swiglu.py", shapes, device,
                    compile=device == "cuda", iters=20 if device == "cuda" else 3,
                    warmup=5 if device == "cuda" else 1)
    demo_shape = gpu_shapes("attn_output_gate", (16384,)) if device == "cuda" else [
        {"T": 17, "Hq": 2, "D": 128}]
    (cached,) = bench_op("attn_output_gate", corpus / "pointer_cache.py", demo_shape, device,
                         compile=False, iters=10 if device == "cuda" else 3, warmup=3)
    (out / "bench_swiglu.json").write_text(json.dumps(
        {"swiglu": [r.to_dict() for r in rows], "cached_cheat": cached.to_dict()}, indent=2))
    for r in rows:
        lines.append(f"bench swiglu {r.shape}: {r.median_us:.2f} us (wall {r.wall_us or 0:.2f}) "
                     f"x_ref {r.x_reference:.2f} x_compile {r.x_compile or 0:.2f} "
                     f"floor {r.pct_of_floor:.0f}% valid={r.valid}")
    lines.append(f"cached cheat timed: {cached.median_us:.2f} us, floor_ok={cached.floor_ok}, "
                 f"valid={cached.valid}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "eval-gpu-out")))
    ap.add_argument("--dry-run", action="store_true", help="CPU, a few variants, small budget")
    ap.add_argument("--only", nargs="*", help="variant names (corpus stem or op/variant)")
    ap.add_argument("--part", choices=("all", "corpus", "registry"), default="all",
                    help="the corpus (cheats and honest variants) or the registry's variants")
    ap.add_argument("--jobs", type=int, default=5,
                    help="verifications at once (ten at once on one H200 timed honest ones out)")
    ap.add_argument("--target", default="h200-tp8-decode", help="target for the GPU widths")
    ap.add_argument("--seeds", type=int, default=2, help="seeds per bucket shape")
    ap.add_argument("--max-tokens", type=int, default=None, help="cap on drawn/long T")
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per verification")
    ap.add_argument("--budget-s", type=float, default=390.0,
                    help="start no new verification after this many seconds")
    ap.add_argument("--no-bench", action="store_true")
    ap.add_argument("--memcheck", action="store_true",
                    help="also run compute-sanitizer's memcheck on Triton/CuTe variants")
    ap.add_argument("--heavy", action="store_true", help=f"also verify {', '.join(HEAVY_OPS)}")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA GPU; run with --dry-run on a CPU machine", file=sys.stderr)
        return 2
    if args.dry_run:
        args.jobs, args.target = min(args.jobs, 2), None
        args.max_tokens = args.max_tokens or 32
    items = plan_items(args.only or (list(DRY_RUN_ITEMS) if args.dry_run else None))
    if args.part != "all":
        items = [i for i in items if i["kind"].startswith(args.part)]
    skipped = []
    if not args.heavy and not args.only:
        skipped = [_skipped(i, "heavy inputs: run alone with --heavy --only "
                               f"{i['name']} --jobs 1 --timeout 540")
                   for i in items if i["op"] in HEAVY_OPS]
        items = [i for i in items if i["op"] not in HEAVY_OPS]
    start = time.monotonic()
    if device == "cuda":
        from autoopt.eval.timing import measure_ceilings

        # Once, alone on the GPU, before the judges share it (their floors divide by it).
        c = measure_ceilings("cuda", refresh=True)
        (args.out / "ceilings.json").write_text(json.dumps(c.__dict__, indent=2))
    results = run_all(items, args, device) + skipped
    lines = write_tables(args.out, results, device, time.monotonic() - start)
    if not args.no_bench and time.monotonic() - start < args.budget_s:
        bench(args.out, device, lines)
    elif not args.no_bench:
        lines.append("bench skipped: the time budget is spent")
    print("\n".join(lines))
    return 0 if all(r["as_expected"] is not False for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
