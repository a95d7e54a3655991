"""Time one registry variant over a grid of its configs, beside the reference, at given T.

    python benchmarks/config_sweep_gpu.py --op gated_o_proj --variant template_splitk_v1 \
        --tokens 1,8 --grid '{"BLOCK_N": [16, 64], "SPLIT_K": [1, 2, 4]}' --out $OUT
    python benchmarks/config_sweep_gpu.py ... --dry-run     (CPU interpreter: the logic only)

The grid's keys are the variant's CONFIG_SPACE keys (unlisted keys keep DEFAULT_CONFIG); each
config runs at the target's widths (h200-tp8-decode), is checked against the reference (largest
raw ulp difference, reported, not judged: `autoopt verify` judges) and timed by CUDA-graph
replay over input sets that exceed the L2 (`autoopt.eval.timing.time_callable`). A config that
fails to compile or run is listed with its error. Writes results.json; prints one line per row,
fastest first per T, and the `autoopt registry tune` command that verifies and proposes the
fastest config of each T (results.json "best").
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoopt.eval.numerics import ulp_diff  # noqa: E402
from autoopt.eval.shapes import gpu_shapes  # noqa: E402
from autoopt.eval.timing import time_callable  # noqa: E402
from model.ops import contract as get_contract  # noqa: E402


def differences(out: tuple, ref: tuple) -> dict:
    """Reported, not judged: the largest raw ulp difference over the floating-point outputs and,
    where an output is integer (the router's expert ids), how many of its elements differ."""
    pairs = list(zip(out, ref, strict=True))
    diff = {"max_ulp": max((int(ulp_diff(o, r).abs().max()) if o.numel() else 0
                            for o, r in pairs if r.is_floating_point()), default=0)}
    whole = [(o, r) for o, r in pairs if not r.is_floating_point()]
    if whole:
        diff["ids_off"] = sum(int((o != r).sum()) for o, r in whole)
    return diff


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--op", required=True)
    p.add_argument("--variant", required=True)
    p.add_argument("--tokens", default="1,8")
    p.add_argument("--grid", default="{}", help="JSON: config key -> list of values.")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "sweep_out")))
    p.add_argument("--dry-run", action="store_true")
    a = p.parse_args()
    if a.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
    dev = "cuda" if torch.cuda.is_available() and not a.dry_run else "cpu"
    c = get_contract(a.op)
    path = ROOT / "kernels" / a.op / f"{a.variant}.py"
    spec = importlib.util.spec_from_file_location(f"sweep_{a.op}_{a.variant}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    grid = json.loads(a.grid)
    unknown = set(grid) - set(getattr(mod, "CONFIG_SPACE", {}))
    if unknown:
        raise SystemExit(f"{a.op}/{a.variant} has no config keys {sorted(unknown)}")
    keys = sorted(grid)
    configs = [dict(zip(keys, vals, strict=True))
               for vals in itertools.product(*(grid[k] for k in keys))]
    tokens = [int(t) for t in a.tokens.split(",")]
    rows = []
    for shape in gpu_shapes(a.op, tokens):
        if a.dry_run:
            shape = {k: (min(v, 256) if isinstance(v, int) and k != "T" else v)
                     for k, v in shape.items()}
        args = c.make_inputs(shape, 0, device=dev)
        ref = c.reference(*args)
        ref = ref if isinstance(ref, tuple) else (ref,)
        sets = lambda n, s=shape: [c.make_inputs(s, 1 + i, device=dev) for i in range(n)]  # noqa: E731
        t0 = time.time()
        base = time_callable(c.reference, sets, device=dev, warmup=3, iters=a.iters)
        rows.append({"shape": shape, "impl": "reference", "us": base.median_us})
        for cfg in [{}] + configs:
            row = {"shape": shape, "impl": a.variant, "config": cfg}
            try:
                out = mod.run(*args, config=cfg)
                out = out if isinstance(out, tuple) else (out,)
                row.update(differences(out, ref))
                tm = time_callable(lambda *x, cfg=cfg: mod.run(*x, config=cfg), sets, device=dev,
                                   warmup=3, iters=a.iters)
                row["us"], row["iqr_us"] = tm.median_us, tm.iqr_us
            except Exception as e:  # noqa: BLE001 (a config that does not compile or run)
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
        done = sorted((r for r in rows if r["shape"] == shape and "us" in r),
                      key=lambda r: r["us"])
        print(f"T={shape['T']} ({time.time() - t0:.0f} s)")
        for r in done + [r for r in rows if r["shape"] == shape and "error" in r]:
            ids = f" ids off {r['ids_off']}" if "ids_off" in r else ""
            print(f"  {r['impl']:20} {json.dumps(r.get('config', {})):60} "
                  f"{r.get('us', float('nan')):8.2f} us  max_ulp {r.get('max_ulp', '-')}{ids} "
                  f"{r.get('error', '')}", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    env = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
           "torch": torch.__version__}
    best = best_configs(rows, a.variant)
    (a.out / "results.json").write_text(json.dumps({"op": a.op, "variant": a.variant, "env": env,
                                                    "rows": rows, "best": best}, indent=1))
    if any(best.values()):
        print("to verify and propose these per bucket (on the GPU; then `autoopt registry accept`):"
              f"\n  autoopt registry tune {a.op} {a.variant} --target h200-tp8-decode --configs "
              f"'{json.dumps(best, separators=(',', ':'))}' --source {a.out / 'results.json'}")


def best_configs(rows: list[dict], variant: str) -> dict[str, dict]:
    """{"T=n": the fastest config of `variant` at T = n}, {} where the defaults were fastest (or
    nothing ran)."""
    best: dict[str, dict] = {}
    for t in sorted({r["shape"]["T"] for r in rows}):
        timed = [r for r in rows if r["shape"]["T"] == t and r["impl"] == variant and "us" in r]
        best[f"T={t}"] = dict(min(timed, key=lambda r: r["us"])["config"]) if timed else {}
    return best


if __name__ == "__main__":
    main()
