"""Serving throughput and latency of the engine on a shard-shaped Beam, at concurrency 1..64.

    python benchmarks/serve_bench.py --out $OUT                 # one GPU (H200), ~2-4 minutes
    python benchmarks/serve_bench.py --dry-run --out /tmp/sb    # CPU, tiny preset (CI)

The model is Beam with fewer layers (`--layers`, default 8: dense MLP at 0-2, full attention at
5 and 7, sliding window 512 elsewhere) and random weights, with the shapes one rank holds under
TP8: hidden 5120, 6 query / 1 KV head of 128, dense intermediate 2560, 256 experts of
intermediate 320 (top-8), vocab 18992. It runs at TP=1, so no all-reduce is timed: these are the
per-rank compute and memory costs of a TP8 deployment, not end-to-end TP8 numbers.

For each concurrency c, c requests (prompt `--prompt-len` random tokens, `--gen-len` tokens,
greedy, stop tokens ignored) arrive at once and run to completion through LLMEngine (continuous
batching, chunked prefill, paged KV, CUDA-graph decode unless --no-cuda-graphs). Reported per c:
TTFT (first token - arrival; includes queueing behind the other prompts' prefill), per-user decode
tokens/s ((tokens - 1) / (last token - first token)), total generated tokens/s over the run's wall
time. Writes serve_bench.json and serve_bench.md under --out (or $OUT).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from model.beam import BeamForCausalLM
from model.config import BeamConfig, preset
from model.serve.engine import EngineConfig, LLMEngine
from model.serve.engine.sampler import SamplingParams

REPO = Path(__file__).resolve().parent.parent


def shard_config(layers: int, dry_run: bool) -> BeamConfig:
    """Beam whose full shapes are one TP8 rank's shard (dry run: the tiny preset)."""
    if dry_run:
        return preset("tiny").replace(num_hidden_layers=layers)
    base = preset("beam-1.0-501b")
    return base.replace(
        num_hidden_layers=layers,
        num_attention_heads=base.num_attention_heads // 8,
        num_key_value_heads=base.num_key_value_heads // 8,
        intermediate_size=base.intermediate_size // 8,
        moe_intermediate_size=base.moe_intermediate_size // 8,
        vocab_size=base.vocab_size // 8,
    )


def random_model(cfg: BeamConfig, device: torch.device, seed: int) -> BeamForCausalLM:
    """Random BF16 weights made on the device (norms near 1, router FP32)."""
    with torch.device(device):
        model = BeamForCausalLM(cfg, dtype=torch.bfloat16)
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    for name, buf in model.named_buffers():
        if name.endswith("norm"):
            buf.normal_(1.0, 0.2, generator=g)
        elif name.endswith(("router_bias", "gate_bias")):
            buf.normal_(0.0, 0.05 if "router" in name else 1.0, generator=g)
        elif name == "embed_tokens":
            buf.normal_(0.0, 1.0, generator=g)
        else:
            buf.normal_(0.0, buf.shape[-1] ** -0.5, generator=g)
    return model


def run_level(engine: LLMEngine, c: int, prompt_len: int, gen_len: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed + c)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
    preempt0 = engine.stats().num_preemptions
    first, last, count = {}, {}, {}
    start = time.monotonic()
    for i in range(c):
        prompt = torch.randint(8, vocab, (prompt_len,), generator=g).tolist()
        engine.add_request(f"c{c}-{i}", prompt, params)
    arrival = {}
    while engine.has_unfinished():
        for out in engine.step():
            rid = out.request_id
            arrival[rid] = out.arrival_time
            if out.new_token_ids:
                first.setdefault(rid, out.time)
                last[rid] = out.time
                count[rid] = out.completion_tokens
    wall = time.monotonic() - start
    ttft = sorted(first[r] - arrival[r] for r in first)
    decode = [(count[r] - 1) / (last[r] - first[r]) for r in first
              if count[r] > 1 and last[r] > first[r]]
    total = sum(count.values())
    return {
        "concurrency": c,
        "ttft_ms_mean": 1e3 * statistics.fmean(ttft),
        "ttft_ms_p50": 1e3 * ttft[len(ttft) // 2],
        "ttft_ms_max": 1e3 * ttft[-1],
        "decode_tok_s_per_user": statistics.fmean(decode) if decode else 0.0,
        "total_tok_s": total / wall,
        "generated_tokens": total,
        "wall_s": wall,
        "preemptions": engine.stats().num_preemptions - preempt0,
    }


def markdown(rows: list[dict], header: str) -> str:
    lines = [header, "", "| concurrency | TTFT mean ms | TTFT p50 ms | TTFT max ms | decode tok/s "
             "per user | total tok/s | wall s |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['ttft_ms_mean']:.1f} | {r['ttft_ms_p50']:.1f} | "
                     f"{r['ttft_ms_max']:.1f} | {r['decode_tok_s_per_user']:.1f} | "
                     f"{r['total_tok_s']:.1f} | {r['wall_s']:.2f} |")
    return "\n".join(lines) + "\n"


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=os.environ.get("OUT"))
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny preset, few requests")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 8)")
    p.add_argument("--concurrency", default=None, help="comma list (default 1,2,4,8,16,32,64)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 512)")
    p.add_argument("--gen-len", type=int, default=None, help="generated tokens (default 128)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--no-cuda-graphs", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    dry = args.dry_run
    args.layers = args.layers or (4 if dry else 8)
    args.concurrency = [int(x) for x in (args.concurrency or ("1,2" if dry else
                                                             "1,2,4,8,16,32,64")).split(",")]
    args.prompt_len = args.prompt_len or (12 if dry else 512)
    args.gen_len = args.gen_len or (6 if dry else 128)
    if args.out is None:
        p.error("--out (or $OUT) is required")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU here: run with --dry-run on a CPU")
    cfg = shard_config(args.layers, args.dry_run)
    t0 = time.monotonic()
    model = random_model(cfg, device, args.seed)
    max_len = args.prompt_len + args.gen_len
    config = EngineConfig(device=str(device), dtype="bfloat16", kernels="reference",
                          max_num_seqs=max(args.concurrency), max_model_len=max_len,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          cuda_graphs=not args.no_cuda_graphs,
                          kv_cache_bytes=64 * 2**20 if args.dry_run else None,
                          seed=args.seed)
    engine = LLMEngine(config, model=model)
    print(engine.startup_report, flush=True)
    run_level(engine, 1, min(args.prompt_len, 16), 4, args.seed + 999)  # warm-up
    setup_s = time.monotonic() - t0
    rows = []
    for c in args.concurrency:
        rows.append(run_level(engine, c, args.prompt_len, args.gen_len, args.seed))
        r = rows[-1]
        print(f"c={c}: TTFT {r['ttft_ms_mean']:.1f} ms, {r['decode_tok_s_per_user']:.1f} tok/s "
              f"per user, {r['total_tok_s']:.1f} tok/s total ({r['wall_s']:.1f} s)", flush=True)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    result = {
        "gpu": gpu, "device": str(device), "torch": torch.__version__,
        "python": platform.python_version(), "git_commit": git_commit(),
        "model": {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
                  "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
                  "experts": cfg.num_experts, "moe_intermediate": cfg.moe_intermediate_size,
                  "vocab": cfg.vocab_size, "shape": "tiny" if args.dry_run else "TP8 rank shard"},
        "engine": {"max_num_seqs": config.max_num_seqs, "max_model_len": max_len,
                   "max_num_batched_tokens": config.max_num_batched_tokens,
                   "cuda_graphs": engine.runner.graphs is not None,
                   "kv_capacity_tokens": engine.cache.capacity_tokens,
                   "notes": engine.runner.notes},
        "prompt_len": args.prompt_len, "gen_len": args.gen_len, "setup_s": setup_s,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "serve_bench.json").write_text(json.dumps(result, indent=2) + "\n")
    header = (f"# serve_bench: {gpu or 'cpu'}, {cfg.num_hidden_layers} layers "
              f"({result['model']['shape']}), prompt {args.prompt_len}, gen {args.gen_len}, "
              f"CUDA graphs {result['engine']['cuda_graphs']}, git {result['git_commit']}")
    (args.out / "serve_bench.md").write_text(markdown(rows, header))
    print(markdown(rows, header))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
