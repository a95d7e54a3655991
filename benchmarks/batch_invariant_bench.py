"""What batch-invariant mode costs, and whether it holds, on one device.

    python benchmarks/batch_invariant_bench.py --out $OUT                 # one H200, ~3-6 minutes
    python benchmarks/batch_invariant_bench.py --dry-run --out bib-dry     # CPU, tiny preset

The model is serve_bench.py's TP8-rank-shaped Beam (random BF16 weights, default 4 layers). For
each mode (default, then `batch_invariant`) it runs:
- throughput: c requests at once (prompt `--prompt-len` random tokens, `--gen-len` greedy
  tokens) for each concurrency c, as serve_bench.py measures it (TTFT, per-user decode tok/s,
  total tok/s);
- invariance: `--check-prompts` prompts run alone and then batched together (greedy, logprobs),
  and each generated token recomputed by prefilling the prompt plus the tokens before it (what a
  preemption does); counts the requests whose tokens or logprobs differ from alone.
Stops starting new levels after `--max-seconds` (default 420) and says so. Writes
batch_invariant.json and batch_invariant.md under --out, and prints the table last.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

from model.serve.engine import EngineConfig, LLMEngine
from model.serve.engine.sampler import SamplingParams

HERE = Path(__file__).resolve().parent


def _serve_bench():
    spec = importlib.util.spec_from_file_location("serve_bench", HERE / "serve_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=os.environ.get("OUT"))
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny preset, few requests")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 4)")
    p.add_argument("--concurrency", default=None, help="comma list (default 1,8,32)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 256)")
    p.add_argument("--gen-len", type=int, default=None, help="generated tokens (default 64)")
    p.add_argument("--check-prompts", type=int, default=None, help="invariance prompts (8)")
    p.add_argument("--max-seconds", type=float, default=420.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    dry = args.dry_run
    args.layers = args.layers or (2 if dry else 4)
    args.concurrency = [int(x) for x in (args.concurrency or ("1,2" if dry else "1,8,32"))
                        .split(",")]
    args.prompt_len = args.prompt_len or (12 if dry else 256)
    args.gen_len = args.gen_len or (4 if dry else 64)
    args.check_prompts = args.check_prompts or (3 if dry else 8)
    if args.out is None:
        p.error("--out (or $OUT) is required")
    return args


def trace(result) -> list[tuple[int, float]]:
    return [(t, lp.logprob) for t, lp in zip(result.token_ids, result.logprobs)]


def invariance(engine: LLMEngine, n: int, prompt_len: int, gen_len: int, seed: int) -> dict:
    """How many of n requests differ batched vs alone, and recomputed vs decoded."""
    g = torch.Generator().manual_seed(seed)
    vocab = engine.model_config.vocab_size
    prompts = [torch.randint(8, vocab, (prompt_len + 3 * i,), generator=g).tolist()
               for i in range(n)]
    params = SamplingParams(max_tokens=gen_len, temperature=0, ignore_eos=True, logprobs=0)
    alone = [engine.generate([p], params)[0] for p in prompts]
    batched = engine.generate(prompts, params)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=0)
    k = max(1, gen_len // 2)  # recompute the k-th token of each request from a prefill
    again = engine.generate([p + a.token_ids[:k] for p, a in zip(prompts, alone)], one)
    return {
        "requests": n,
        "batched_tokens_differ": sum(a.token_ids != b.token_ids for a, b in zip(alone, batched)),
        "batched_logprobs_differ": sum(trace(a) != trace(b) for a, b in zip(alone, batched)),
        "recomputed_differ": sum(trace(a)[k] != trace(r)[0] for a, r in zip(alone, again)),
    }


def run_mode(args, sb, cfg, device, invariant: bool, deadline: float) -> dict:
    model = sb.random_model(cfg, device, args.seed)
    config = EngineConfig(device=str(device), dtype="bfloat16", kernels="reference",
                          max_num_seqs=max(max(args.concurrency), args.check_prompts),
                          max_model_len=args.prompt_len + 3 * args.check_prompts + args.gen_len,
                          kv_cache_bytes=64 * 2**20 if args.dry_run else None,
                          batch_invariant=invariant, seed=args.seed)
    engine = LLMEngine(config, model=model)
    sb.run_level(engine, 1, min(args.prompt_len, 16), 4, args.seed + 999)  # warm-up
    rows, skipped = [], []
    for c in args.concurrency:
        if time.monotonic() > deadline:
            skipped.append(c)
            continue
        rows.append(sb.run_level(engine, c, args.prompt_len, args.gen_len, args.seed))
        r = rows[-1]
        print(f"{'invariant' if invariant else 'default'} c={c}: {r['total_tok_s']:.1f} tok/s "
              f"total, TTFT {r['ttft_ms_mean']:.1f} ms ({r['wall_s']:.1f} s)", flush=True)
    check = invariance(engine, args.check_prompts, min(args.prompt_len, 64),
                       min(args.gen_len, 16), args.seed + 7)
    notes = engine.runner.notes
    del engine, model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"batch_invariant": invariant, "rows": rows, "skipped_concurrency": skipped,
            "invariance": check, "notes": notes}


def markdown(result: dict) -> str:
    base = {r["concurrency"]: r["total_tok_s"] for r in result["modes"][0]["rows"]}
    lines = [result["header"], "", "| mode | concurrency | total tok/s | x default | TTFT mean ms "
             "| decode tok/s per user |", "|---|---:|---:|---:|---:|---:|"]
    for mode in result["modes"]:
        name = "batch-invariant" if mode["batch_invariant"] else "default"
        for r in mode["rows"]:
            ratio = r["total_tok_s"] / base[r["concurrency"]] if r["concurrency"] in base else 0
            lines.append(f"| {name} | {r['concurrency']} | {r['total_tok_s']:.1f} | {ratio:.2f} "
                         f"| {r['ttft_ms_mean']:.1f} | {r['decode_tok_s_per_user']:.1f} |")
    lines += ["", "| mode | requests | batched: tokens differ | batched: logprobs differ | "
              "recomputed token differs |", "|---|---:|---:|---:|---:|"]
    for mode in result["modes"]:
        name = "batch-invariant" if mode["batch_invariant"] else "default"
        c = mode["invariance"]
        lines.append(f"| {name} | {c['requests']} | {c['batched_tokens_differ']} | "
                     f"{c['batched_logprobs_differ']} | {c['recomputed_differ']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here: run with --dry-run on a CPU")
    sb = _serve_bench()
    cfg = sb.shard_config(args.layers, args.dry_run)
    deadline = time.monotonic() + args.max_seconds
    modes = [run_mode(args, sb, cfg, device, invariant, deadline) for invariant in (False, True)]
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    result = {
        "gpu": gpu, "device": str(device), "torch": torch.__version__,
        "git_commit": sb.git_commit(), "layers": cfg.num_hidden_layers,
        "shape": "tiny" if args.dry_run else "TP8 rank shard", "prompt_len": args.prompt_len,
        "gen_len": args.gen_len, "modes": modes,
        "header": (f"# batch_invariant_bench: {gpu or 'cpu'}, {cfg.num_hidden_layers} layers, "
                   f"prompt {args.prompt_len}, gen {args.gen_len}, git {sb.git_commit()}"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "batch_invariant.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "batch_invariant.md").write_text(markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
