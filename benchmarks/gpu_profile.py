"""The served step on one H200: `bench model` tables and a profile with graph-replay attribution.

    python benchmarks/gpu_profile.py --out DIR [--before-lock LOCK]   # ~8 minutes on one H200
    python benchmarks/gpu_profile.py --dry-run --out DIR              # the same stages on the CPU

One process, stages in this order (each bounded by its share of --budget-s, written as soon as
it finishes, so a slow later stage never costs an earlier one's results):
1. decode: h200-tp8-decode, all 52 layers of one TP8 rank (random weights filled on the GPU),
   batch 1/8/32/64 at context 8192 and batch 1/8 at the long context 100000: --baseline vs
   tuned (vs --before-lock, the lock a comparison starts from);
2. prefill: h200-tp8-prefill, 8 prompts x 2048 tokens, the baseline vs tuned (with the
   reference MoE, a host-syncing loop over experts, one eager prefill step takes 5 s on an H200
   and the baseline row alone spent the stage's share);
3. profile: the served decode step (tuned set, CUDA-graph replay) at batch 1 and 64, context
   8192, kernel time attributed to ops inside the graph, plus a 16-kernel Nsight Compute sample
   of the top ops where ncu is installed; then the compile set's step at batch 1, to compare
   op by op (unless --skip-compile);
4. compile: the torch.compile set of decode (both contexts) and prefill (Inductor compiles each
   op once per argument kind), and for decode `tuned+compile` (the lock, Inductor for the rest),
   merged into the tables of stages 1 and 2.
Files under --out: bench_decode.{json,md,png}, bench_prefill.{json,md,png}, profile-b1.json/png,
profile-b64.json/png, profile-compile-b1.json/png, summary.txt (also printed last).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autoopt.bench_model import BenchModelArgs, merge_results, run_bench  # noqa: E402
from autoopt.bench_model_report import headline, write_outputs  # noqa: E402
from autoopt.profiler import profile_batches  # noqa: E402
from autoopt.profiler.report import summary  # noqa: E402
from autoopt.profiler.report import write_outputs as write_profile  # noqa: E402

GPU = {"decode": ("h200-tp8-decode", (1, 8, 32, 64), (8192,), (1, 8), 100000),
       "prefill": ("h200-tp8-prefill", (8,), (2048,)), "profile": (1, 64), "context": 8192}
DRY = {"decode": ("cpu-tiny", (1, 3), (40,), (1,), 64),
       "prefill": ("cpu-tiny", (2,), (24,)), "profile": (1, 3), "context": 40}
ROW_S = 15.0  # an eager reference step at batch 64 takes seconds: 5 of them, not 20
# Measured on an H200 (525 s budget): decode 92 s, prefill 83, profile 42, compile 182.
SHARES = {"decode": 0.25, "prefill": 0.15, "profile": 0.2, "compile": 0.4}


class Run:
    def __init__(self, out: Path, budget_s: float, proxy: bool) -> None:
        self.out, self.start, self.budget_s = out, time.monotonic(), budget_s
        self.dry_proxy = proxy
        self.lines: list[str] = []
        self.errors: list[str] = []

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.start:6.1f} s] {text}", flush=True)

    def share(self, stage: str) -> float:
        left = self.budget_s - (time.monotonic() - self.start)
        return max(30.0, min(left, SHARES[stage] * self.budget_s))

    def stage(self, name: str, fn) -> object:
        t0 = time.monotonic()
        self.say(f"== {name}")
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - one failed stage must not lose the others
            self.errors.append(f"{name}: {type(e).__name__}: {e}")
            traceback.print_exc()
            result = None
        self.say(f"== {name}: {time.monotonic() - t0:.0f} s")
        return result


def _bench(run: Run, stem: str, target: str, batches, contexts, sets, budget, phase=None,
           layers=None, before=None):
    iters = 5 if phase == "prefill" else None  # a prefill step is ~100x a decode step
    args = BenchModelArgs(target, batches=batches, contexts=contexts, kernels=sets,
                          phase=phase, layers=layers, iters=iters, budget_s=budget,
                          proxy=run.dry_proxy, row_s=ROW_S)
    res = run_bench(args, say=run.say)
    if before is not None:
        res = merge_results(before, res)
    _write_flat(run.out, stem, res)  # now: a later stage that overruns cannot lose it
    return res


def _write_flat(out: Path, stem: str, res) -> None:
    """<stem>.{json,md,png} (flat: few files come back from the GPU machine)."""
    d = out / f".{stem}"
    write_outputs(res, d)
    for ext in ("json", "md", "png"):
        (d / f"bench_model.{ext}").replace(out / f"{stem}.{ext}")
    d.rmdir()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "runs/gpu-profile"))
    p.add_argument("--dry-run", action="store_true", help="cpu-tiny on the CPU (tests)")
    p.add_argument("--budget-s", type=float, default=480.0, help="wall-clock budget")
    p.add_argument("--before-lock", default=None, help="a lock file to compare against")
    p.add_argument("--baseline", default="reference",
                   help="the decode set the others are compared with: reference, or a lock file "
                        "(benchmarks/moe-only.lock.toml: the reference kernels with a capturable "
                        "MoE, so that the baseline is replayed from a CUDA graph as the server "
                        "would; the reference MoE syncs with the host and runs eagerly)")
    p.add_argument("--skip-compile", action="store_true", help="no torch.compile stage")
    p.add_argument("--proxy", action="store_true", help="allow a GPU other than the H200")
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = DRY if a.dry_run else GPU
    run = Run(out, a.budget_s, a.proxy)
    sets = (a.baseline, "tuned") + ((a.before_lock,) if a.before_lock else ())
    target, batches, ctxs, long_batches, long_ctx = cfg["decode"]
    decode = run.stage("decode bench", lambda: _bench(
        run, "bench_decode", target, batches, ctxs, sets, run.share("decode")))
    if decode is not None and long_ctx:
        decode = run.stage("decode bench, long context", lambda: _bench(
            run, "bench_decode", target, long_batches, (long_ctx,), sets,
            0.4 * run.share("decode"), layers=decode.layers, before=decode)) or decode
    ptarget, pbatches, pctx = cfg["prefill"]
    prefill = run.stage("prefill bench", lambda: _bench(
        run, "bench_prefill", ptarget, pbatches, pctx, (a.baseline, "tuned"),
        run.share("prefill"), phase="prefill"))
    profiles = run.stage("served-step profile", lambda: _profile(run, target, cfg,
                                                                    not a.skip_compile))
    if not a.skip_compile:
        if decode is not None:
            decode = run.stage("decode compile", lambda: _bench(
                run, "bench_decode", target, batches, ctxs, ("compile", "tuned+compile"),
                0.5 * run.share("compile"), layers=decode.layers, before=decode)) or decode
            if long_ctx:  # the peer at the long context too: attention dominates there
                decode = run.stage("decode compile, long context", lambda: _bench(
                    run, "bench_decode", target, long_batches, (long_ctx,),
                    ("compile", "tuned+compile"), 0.15 * run.share("compile"),
                    layers=decode.layers, before=decode)) or decode
        if prefill is not None:
            prefill = run.stage("prefill compile", lambda: _bench(
                run, "bench_prefill", ptarget, pbatches, pctx, ("compile",),
                run.share("compile"), phase="prefill", layers=prefill.layers,
                before=prefill)) or prefill
    return _summary(run, decode, prefill, profiles)


def _profile(run: Run, target: str, cfg: dict, compile_too: bool) -> list:
    """The tuned step at the profile's batches (with an Nsight sample), then, when asked, the
    compile set's at the first batch: where Inductor's kernels beat the registry's, op by op."""
    from autoopt.profiler.nsight import find_ncu

    budget = run.share("profile")
    deadline = time.monotonic() + budget
    profs = profile_batches(target, cfg["profile"], kernels="tuned", context=cfg["context"],
                            repeats=10, ncu_sample=16 if find_ncu() else 0,
                            ncu_timeout_s=min(120.0, budget / 2), proxy=run.dry_proxy,
                            deadline=deadline - (0.3 * budget if compile_too else 0.0))
    for prof in profs:
        write_profile(prof, run.out, f"profile-b{prof.batch}")
    if compile_too and time.monotonic() < deadline - 20:
        for prof in profile_batches(target, cfg["profile"][:1], kernels="compile",
                                    context=cfg["context"], repeats=10, proxy=run.dry_proxy,
                                    deadline=deadline):
            write_profile(prof, run.out, f"profile-compile-b{prof.batch}")
    return profs


def _summary(run: Run, decode, prefill, profiles) -> int:
    lines = []
    for name, res in (("decode", decode), ("prefill", prefill)):
        if res is not None:
            lines.append(f"{name}: {res.target} on {res.gpu}, {res.layers} layers, "
                         f"{res.rates['bandwidth_bytes_s'] / 1e12:.2f} TB/s "
                         f"({res.rates['source']}), versions {json.dumps(res.versions)}")
            lines += [f"  {h}" for h in headline(res)]
    for prof in profiles or []:
        lines += [f"profile b{prof.batch}: " + s for s in summary(prof)[:3]]
        top = sorted(prof.ops(), key=lambda r: -r.time_us)[:5]
        lines.append("  top: " + ", ".join(f"{r.op} {r.share:.0f}% ({r.kernels} kernels)"
                                           for r in top))
        sample = prof.checks.get("ncu_sample")
        if sample:
            lines.append(f"  ncu sample: {sample.get('error') or len(sample['kernels'])} "
                         f"kernels of {sample['ops']}")
    lines += [f"error: {e}" for e in run.errors]
    lines.append(f"total {time.monotonic() - run.start:.0f} s; files in {run.out}")
    (run.out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 1 if decode is None and prefill is None else 0


if __name__ == "__main__":
    sys.exit(main())
