"""Verify and time every registry variant of the hand-written ops; write their records.

On the H200 (a few minutes):
    python benchmarks/gpu_kernels.py --out $OUT
verifies each variant on cuda with autoopt.eval's `verify_variant` (real Beam TP8 per-rank
shapes, several seeds; the five verifications run in parallel child processes), then times it
with `bench_op` (reference, torch.compile and the variant in one child, CUDA-graph replay) at
decode T = 1, 8, 32, 128 (h200-tp8-decode) and prefill T = 2048, 16384 (h200-tp8-prefill) shapes
of `preset("beam-1.0-501b").shard(8)`. For each variant it writes
`$OUT/<op>/records/<variant>.json` through the registry's own writer (the same one as
`autoopt registry record`: this arch's verification and this GPU's rows replace earlier ones,
everything else in the record is kept; $OUT is a registry holding copies of the variants) and
prints a compact table; `$OUT/summary.json` holds all rows. Copy the records into kernels/ to
commit them (or pass --write-registry). Exit 0 when every variant verified and was timed, 1
otherwise. `--no-compile` skips the torch.compile baselines
(the slowest part) and `--ops` splits the run.

`--device cpu` does the same on CPU (Triton interpreter; timings not meaningful for speed);
`--dry-run` is that with tiny shapes, one seed and no torch.compile (a test runs it).
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

OPS = ("rmsnorm", "norm_residual_norm", "attn_output_gate", "swiglu", "logit_softcap")
DECODE_TOKENS = (1, 8, 32, 128)
PREFILL_TOKENS = (2048, 16384)
DRY_TOKENS = (1, 3)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_kernels_out")),
                   help="Output directory (default: $OUT).")
    p.add_argument("--ops", default=",".join(OPS), help="Comma-separated ops.")
    p.add_argument("--variants", default=None,
                   help="Comma-separated variants: NAME (of every op in --ops) or OP/NAME "
                   "(default: all).")
    p.add_argument("--registry", type=Path, default=None, help="Registry dir (default: kernels/).")
    p.add_argument("--device", default=None, help="cuda (default when present) or cpu.")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: check the logic.")
    p.add_argument("--no-compile", action="store_true", help="Skip torch.compile baselines.")
    p.add_argument("--seeds", type=int, default=3, help="Secret seeds per verified shape.")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--jobs", type=int, default=5, help="Verifications run in parallel.")
    p.add_argument("--memcheck", action="store_true",
                   help="Also run each Triton/CuTe variant under compute-sanitizer's memcheck.")
    p.add_argument("--verify-timeout", type=float, default=600.0,
                   help="Seconds each of the judge's workers may run per verification.")
    p.add_argument("--agent", default="hand-written", help="Provenance for unrecorded variants.")
    p.add_argument("--target", default=None,
                   help="Verify at this target's widths and buckets (default: every shipped "
                        "target of the local GPU).")
    p.add_argument("--decode-tokens", default=",".join(map(str, DECODE_TOKENS)),
                   help="Token counts timed at h200-tp8-decode's widths.")
    p.add_argument("--prefill-tokens", default=",".join(map(str, PREFILL_TOKENS)),
                   help="Token counts timed at h200-tp8-prefill's widths.")
    p.add_argument("--bench-only", default="",
                   help="Comma-separated OP/VARIANT: time these without verifying them again "
                        "(their record must already pass on this arch for the file as it is); "
                        "without --variants, nothing else runs.")
    p.add_argument("--write-registry", action="store_true",
                   help="Also write the merged records into the registry itself.")
    return p.parse_args(argv)


def bench_plan(op: str, device: str, dry: bool, decode: tuple[int, ...] = DECODE_TOKENS,
               prefill: tuple[int, ...] = PREFILL_TOKENS) -> list[tuple[str, dict]]:
    """(target, shape) pairs to time."""
    from autoopt.eval.shapes import cpu_shapes
    from model.config import preset
    from model.ops import contract

    if dry or device == "cpu":
        return [("cpu-tiny", s) for s in cpu_shapes(op, DRY_TOKENS)]
    from autoopt.targets import load_target

    cfg = preset("beam-1.0-501b")
    shard = cfg.shard(8)
    c = contract(op)
    out = []
    for name, tokens in (("h200-tp8-decode", decode), ("h200-tp8-prefill", prefill)):
        target = load_target(name)
        for t in tokens:
            if "context" not in inspect.signature(c.shapes_for).parameters:
                out.append((name, dict(c.shapes_for(cfg, t, shard))))
                continue
            # Over the keys the target serves: decode rows at its first context, prefill chunks
            # of its prompt length (one sequence each), not a context of T keys; on a
            # sliding-window layer and on a full-attention one (which reads every key).
            ctx = target.contexts[0]
            seqs = 0 if target.phase == "decode" else max(1, t // ctx)
            for layer in _attention_layers(cfg):
                out.append((name, dict(c.shapes_for(
                    cfg, t, shard, context=max(ctx, t) if seqs == 0 else ctx, seqs=seqs,
                    layer=layer))))
    return out


def _attention_layers(cfg) -> list[int]:
    """The first sliding-window layer and the first full-attention layer (either may be absent)."""
    layers = range(cfg.num_hidden_layers)
    slide = next((i for i in layers if cfg.window(i) is not None), None)
    full = next((i for i in layers if cfg.window(i) is None), None)
    return [i for i in (slide, full) if i is not None]


def verify_shapes(op: str, device: str, dry: bool) -> list[dict] | None:
    from autoopt.eval.shapes import cpu_shapes

    return cpu_shapes(op, DRY_TOKENS) if dry else None  # None: autoopt.eval's defaults


def verify_all(jobs: list[tuple[str, str, Path]], device: str, seeds: int, dry: bool,
               workers: int, target: str | None = None, timeout_s: float = 600,
               done=None, memcheck: bool = False) -> dict[tuple[str, str], dict]:
    """The judge's report per (op, variant); `done(op, name, report)` as each one finishes, so
    a run cut short keeps the verifications that ended."""
    from autoopt.registry_record import verify

    def one(job):
        op, name, source = job
        return (op, name), verify(op, source, device, seeds, verify_shapes(op, device, dry),
                                  timeout_s=timeout_s, target=target, memcheck=memcheck)

    reports = {}
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = {pool.submit(one, job): job for job in jobs}
        for fut in as_completed(futures):
            try:
                key, report = fut.result()
            except Exception as exc:  # noqa: BLE001 - the judge itself failed: say so, go on
                op, name, _ = futures[fut]
                print(f"{op}/{name}: the judge failed, nothing recorded: "
                      f"{type(exc).__name__}: {str(exc)[:300]}", flush=True)
                continue
            reports[key] = report
            if done is not None:
                done(*key, report)
    return reports


def bench(op: str, source: Path, plan: list[tuple[str, dict]], device: str, args,
          on_rows=None) -> list[dict]:
    """Rows of `op`'s variant at `plan`; `on_rows(rows so far)` after each shape."""
    from autoopt.registry_record import bench as bench_rows

    dry = args.dry_run
    rows = bench_rows(op, source, plan, device, warmup=1 if dry else args.warmup,
                      iters=2 if dry else args.iters, compile=not (dry or args.no_compile),
                      timeout_s=900, on_rows=on_rows)
    return with_selection(op, rows, plan, device, args)


def with_selection(op: str, rows: list[dict], plan: list[tuple[str, dict]], device: str,
                   args) -> list[dict]:
    """A composite op without a variant of its own is served as the composition of its locked
    parts: time that module at each shape (its part's config per bucket) and put it beside the
    candidate's rows (selection_us, x_selection), the bar `gpu_accept.py` holds it to."""
    from autoopt.eval import bench_op
    from model.registry import Registry, current_arch, gpu_name
    from model.registry.composite import composed_selection

    shapes = [s for _, s in plan]
    sel = composed_selection(Registry(args.registry), op, current_arch(device),
                             gpu_name(device) if device != "cpu" else "cpu", shapes)
    if sel is None or not rows:
        return rows
    path = args.out / "composed" / f"{op}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(sel.source)
    dry = args.dry_run
    for row in rows:
        shape = row["shape"]
        (base,) = bench_op(op, path, [shape], device, warmup=1 if dry else args.warmup,
                           iters=2 if dry else args.iters, compile=False, timeout_s=900,
                           config=sel.per_bucket.get(f"T={int(shape['T'])}"))
        row.update(selection=sel.label, selection_us=base.median_us,
                   x_selection=base.median_us / row["median_us"])
    return rows


def out_registry(reg, out: Path, op: str, name: str):
    """$OUT as a registry holding a copy of the variant and its current record."""
    from model.registry import Registry

    dst = Registry(out)
    for src_path, dst_path in ((reg.variant_path(op, name), dst.variant_path(op, name)),
                               (reg.record_path(op, name), dst.record_path(op, name))):
        if src_path.is_file():
            dst_path.parent.mkdir(parents=True, exist_ok=True)
            dst_path.write_bytes(reg.safe_bytes(src_path))
    return dst


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def print_table(results: list[dict]) -> None:
    print(f"{'op':<20} {'variant':<11} {'verify':<7} {'target':<17} {'shape':<22} "
          f"{'us':>9} {'x ref':>6} {'x cmp':>6} {'%floor':>6}")
    for r in results:
        for b in r["rows"] or [{}]:
            shape = ",".join(f"{k}={v}" for k, v in (b.get("shape") or {}).items())
            xc = b.get("x_compile")
            print(f"{r['op']:<20} {r['variant']:<11} {r['verdict']:<7} {b.get('target', '-'):<17} "
                  f"{shape:<22} {b.get('median_us', float('nan')):>9.2f} "
                  f"{b.get('x_reference', float('nan')):>6.2f} "
                  f"{xc if xc is not None else float('nan'):>6.2f} "
                  f"{b.get('pct_of_floor', float('nan')):>6.1f}")
        for reason in r["reasons"][:3]:
            print(f"    rejected: {reason}")
        if r["bench_error"]:
            print(f"    benchmark failed: {r['bench_error'][:500]}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        args.device = "cpu"
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else None)
    if device is None:
        print("no CUDA device: run on the GPU machine, or pass --device cpu / --dry-run",
              file=sys.stderr)
        return 2
    from autoopt.registry_record import record_evidence
    from model.registry import Benchmark, Registry, current_arch, writers

    reg = Registry(args.registry)
    wanted = set(args.variants.split(",")) if args.variants else None
    jobs = [(op, name, reg.variant_path(op, name)) for op in args.ops.split(",")
            for name in reg.variants(op)
            if wanted is None or name in wanted or f"{op}/{name}" in wanted]
    timed_only = [tuple(x.split("/", 1)) for x in args.bench_only.split(",") if x.strip()]
    # With --bench-only and no --variants, only those are timed (nothing else is verified).
    jobs = [j for j in jobs if (j[0], j[1]) not in timed_only and (wanted or not timed_only)]
    if not jobs and not timed_only:
        print(f"no variants of {args.ops} in {reg.root}", file=sys.stderr)
        return 2
    arch = current_arch(device)
    seeds = 1 if args.dry_run else args.seeds
    start = time.monotonic()
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")

    def verified(op: str, name: str, report: dict) -> None:  # written now, timed later
        out = out_registry(reg, args.out, op, name)
        # Into the registry too, so that a call cut off before the timing keeps the verdict
        # (a later call times it with --bench-only).
        for dst in (out, reg) if args.write_registry else (out,):
            record_evidence(dst, op, name, device, report, [], args.agent)
        print(f"{op}/{name}: {report['verdict']} after {time.monotonic() - start:.0f} s "
              f"{'; '.join(report['reasons'][:2])}", flush=True)

    print(f"verifying {len(jobs)} variants, {args.jobs} at once", flush=True)
    reports = verify_all(jobs, device, seeds, args.dry_run, args.jobs, args.target,
                         args.verify_timeout, verified, args.memcheck)
    for op, name in timed_only:  # verified earlier on this arch: only timed now
        rec = reg.read_record(op, name)
        if rec is None or not rec.verified(arch, reg.read_variant(op, name)[0].sha256):
            print(f"--bench-only {op}/{name}: no passing {arch} verification of the file as it "
                  "is; verify it instead", file=sys.stderr)
            return 2
        reports[(op, name)] = {"verdict": "pass", "reasons": [], "earlier": True}
        jobs.append((op, name, reg.variant_path(op, name)))
    print(f"verified {len(jobs)} variants on {device} ({arch}) in "
          f"{time.monotonic() - start:.0f} s", flush=True)
    results = []
    for op, name, source in jobs:
        report = reports.get((op, name))
        if report is None:
            continue
        t0 = time.monotonic()
        bench_error = None
        out = out_registry(reg, args.out, op, name)

        written: set[str] = set()  # GPUs whose rows a cut-off or failed run left

        def write(rows, op=op, name=name, report=report, out=out, written=written) -> None:
            written.update(Benchmark(r).gpu for r in rows)
            drop = () if rows else sorted(written)
            for dst in (out, reg) if args.write_registry else (out,):
                # The verification is already in the record (earlier, or in `verified` above
                # when the registry is written): add this GPU's rows to it.
                if report.get("earlier") or args.write_registry:
                    writers.record(dst, op, name, [], rows, args.agent, drop)
                else:
                    record_evidence(dst, op, name, device, report, rows, args.agent, drop)

        try:
            if report["verdict"] != "pass":
                raise ValueError("not timed: rejected")
            plan = bench_plan(op, device, args.dry_run, _ints(args.decode_tokens),
                              _ints(args.prefill_tokens))
            # Each shape's rows are written as they come: a stage cut off keeps them.
            rows = bench(op, source, plan, device, args, on_rows=write)
        except (RuntimeError, ValueError) as exc:  # one op's failure must not lose the others
            # No rows of a run that failed (a variant caught attempting blocked operations at
            # its end included): the shapes it had written are dropped again.
            rows, bench_error = [], str(exc)
        write(rows)
        path = out.record_path(op, name)
        results.append({"op": op, "variant": name, "verdict": report["verdict"],
                        "reasons": report["reasons"], "rows": rows, "record": str(path),
                        "bench_error": bench_error})
        print(f"{op}/{name}: {report['verdict']}, timed {len(rows)} shapes in "
              f"{time.monotonic() - t0:.0f} s -> {path}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {"device": device, "arch": arch, "elapsed_s": time.monotonic() - start,
               "results": results}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    print_table(results)
    print(f"total {time.monotonic() - start:.0f} s")
    return 0 if all(r["verdict"] == "pass" and not r["bench_error"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
