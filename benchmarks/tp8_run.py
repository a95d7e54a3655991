"""TP8 on eight H200s in one bounded call (TP2 on two; the one-shot kernel alone on one).

    python benchmarks/tp8_run.py --gpus 8 --out $OUT        # ~9 min: the TP8 deployment
    python benchmarks/tp8_run.py --gpus 2 --out $OUT        # TP2 (each rank a TP8 shard)
    python benchmarks/tp8_run.py --gpus 1 --out $OUT        # ~2 min: the one-shot kernel, one GPU
    python benchmarks/tp8_run.py --gpus 2 --dry-run --out DIR   # CPU, gloo, tiny shapes

Stages, each a child process with its own time limit (what a stage wrote stays if it runs out):
  sim       (--gpus 1) R = 2, 3, 8 simulated ranks' buffers on one GPU: the one-shot boundary
            bitwise against triton_v1 and the op's reference at T = 1, 8, 64, 2048, its timings
            (a "peer" read is a local read here), and 2 and 3 processes sharing the GPU's
            buffers through CUDA IPC (the real exchange and barrier)
  parity    TPn vs TP1 on a model one GPU holds (Beam's widths, 4 layers, 16 experts): FP32
            greedy tokens equal and logits within the TP tolerance; BF16 with the one-shot
            boundary bitwise equal to the all-gather one, and its noise against TP1
  boundary  benchmarks/tp_bench.py: per-boundary latency at T = 1, 8, 64, 2048 of NCCL
            all-reduce + unfused norms, NCCL all-gather + fused triton_v1, and the one-shot fused
            boundary (eager and CUDA graph), each checked bitwise against the reference
  steps     benchmarks/tp_bench.py on the 52-layer model (each rank its real TP8 slice, random
            weights filled on the GPU): decode steps at batch 1, 8, 32, 64 per boundary, against
            the per-rank floor plus the measured communication floor
  serve     `autoopt generate --tp n` on the 52-layer random-weights model directory
  bench_model  `autoopt bench model --tp n` where the CLI has --tp (skipped otherwise)
Everything lands under --out (tp8_run.json, <stage>.log, <stage>/...); a table is printed last.
Only GPUs with CUDA peer access are used peer-to-peer; NVLink multicast stays off throughout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from model import p2p  # noqa: E402
from model.config import BeamConfig, preset  # noqa: E402
from model.ops import allreduce_norm_residual_norm as arn  # noqa: E402
from model.parallel import TPGroup, attach, launch  # noqa: E402

STAGES = ("sim", "parity", "boundary", "steps", "serve", "bench_model")
# Seconds each stage may take (a stage also gets no more than what is left of --budget).
LIMITS = {"sim": 150, "parity": 170, "boundary": 120, "steps": 250, "serve": 110,
          "bench_model": 200}
TOKENS = [1, 8, 64, 2048]
BATCHES = [1, 8, 32, 64]
PROMPTS = [[7, 100, 200, 300, 1500, 2047, 9], [7, 5, 1024, 1023, 2000, 42, 11]]
NEW_TOKENS = 8
FUSED = REPO / "kernels" / "allreduce_norm_residual_norm" / "triton_v1.py"


# ---- shapes -------------------------------------------------------------------------------------
def parity_config(dry: bool) -> BeamConfig:
    """A model one GPU holds with Beam's widths (H 5120, 48/8 heads), or tiny with 8 heads."""
    if dry:
        return preset("tiny").replace(num_attention_heads=8)
    return preset("beam-1.0-501b").replace(num_hidden_layers=4, vocab_size=16384,
                                           intermediate_size=5120, num_experts=16,
                                           moe_intermediate_size=1024)


def serve_config(tp: int, dry: bool) -> BeamConfig:
    """The 52-layer model with each of `tp` ranks holding one TP8 rank's shard."""
    if dry:
        return preset("tiny").replace(num_attention_heads=8)
    from tp_bench import shard_config

    return shard_config(tp, 52, dry_run=False)


def write_checkpoint(path: Path, cfg: BeamConfig, device: str, seed: int = 0) -> Path:
    """A Beam checkpoint in the HF layout, its random tensors made on `device` (fast on a GPU)."""
    from safetensors.torch import save_file

    from model.serve.tokenizer import write_tokenizer_files
    from model.weights import expected_tensors

    if (path / "model.safetensors").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for spec in expected_tensors(cfg):
        x = torch.randn(spec.shape, generator=g, device=device)
        name = spec.name
        if name.endswith("norm.weight"):
            x = 1.0 + 0.2 * x
        elif name.endswith("e_score_correction_bias"):
            x = 0.05 * x
        elif not name.endswith(("gate_bias", "embed_tokens.weight")):
            x = x * (4 * cfg.initializer_range)
        tensors[name] = (x.float() if spec.fp32 else x.to(torch.bfloat16)).cpu()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg.replace(extra={**cfg.extra, "dtype": "bfloat16"}).save(path / "config.json")
    gen = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
           "pad_token_id": cfg.pad_token_id, "do_sample": False}
    (path / "generation_config.json").write_text(json.dumps(gen) + "\n")
    write_tokenizer_files(path, cfg.vocab_size)
    return path


def _dump(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


# ---- sim: the one-shot kernel on one device -------------------------------------------------
def _time_graph(fn, repeats: int = 20, inner: int = 10) -> float:
    """Median µs per call of `fn`, replayed from a CUDA graph of `inner` calls."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / inner)
    return sorted(samples)[len(samples) // 2]


def _sim_case(kernels, ranks: int, tokens: int, hidden: int, dev: str, views) -> dict:
    v1, oneshot = kernels
    args = arn.make_inputs({"R": ranks, "T": tokens, "H": hidden}, seed=tokens, device=dev)
    want = arn.reference(*args)
    same = lambda a, b: all(torch.equal(x, y) for x, y in zip(a, b, strict=True))  # noqa: E731
    row = {"R": ranks, "T": tokens, "H": hidden,
           "triton_v1_bitwise": same(v1.run(*args), want),
           "oneshot_stacked_bitwise": same(oneshot.run(*args), want),
           "oneshot_ranks_bitwise": all(same(o, want) for o in p2p.simulate_boundary(views, *args))}
    if dev == "cuda":
        partials, rest = args[0], args[1:]
        publish = lambda: [v.publish(partials[v.rank]) for v in views]  # noqa: E731
        both = lambda: (publish(), views[0].wait_boundary(*rest))  # noqa: E731
        row["triton_v1_us"] = _time_graph(lambda: v1.run(*args))
        row["oneshot_stacked_us"] = _time_graph(lambda: oneshot.run(*args))
        row["publish_all_ranks_us"] = _time_graph(publish)
        row["publish_all_then_rank0_boundary_us"] = _time_graph(both)
        # One rank's share: its publish plus its row program (the peers already published).
        row["one_rank_boundary_us"] = (row["publish_all_then_rank0_boundary_us"]
                                       - row["publish_all_ranks_us"] * (ranks - 1) / ranks)
    return row


def _ipc_rank(group: TPGroup, calls: list[int], hidden: int) -> list[bool]:
    dev = torch.device("cuda", 0)
    view = p2p.exchange(group.pg, group.rank, group.size,
                        p2p.RankBuffers.allocate(group.size, max(calls), hidden, dev))
    ok = []
    for i, t in enumerate(calls):
        partials, *rest = arn.make_inputs({"R": group.size, "T": t, "H": hidden}, seed=i,
                                          device=dev)
        got = view.boundary(partials[group.rank], *rest)
        ok.append(all(torch.equal(a, b) for a, b in zip(got, arn.reference(partials, *rest))))
    view.check()
    return ok


def stage_sim(opts) -> dict:
    from model.registry import Registry

    dev, hidden = ("cpu", 64) if opts.dry_run else ("cuda", 5120)
    tokens = [1, 3] if opts.dry_run else TOKENS
    reg = Registry()
    kernels = (reg.load_variant(arn.NAME, "triton_v1"), reg.load_variant(arn.NAME, "oneshot_v1"))
    out: dict = {"device": _device_name(), "rows": [], "ipc": {}}
    for ranks in (2, 3) if opts.dry_run else (2, 3, 8):
        views = p2p.simulate_ranks(ranks, max(tokens), hidden, dev)
        for t in tokens:
            out["rows"].append(_sim_case(kernels, ranks, t, hidden, dev, views))
            _dump(Path(opts.out) / "sim.json", out)
        for v in views:
            v.check()
    if not opts.dry_run:
        for ranks in (2, 3):
            out["ipc"][str(ranks)] = launch(_ipc_rank, ranks, "gloo",
                                            args=([1, 8, 64, 3, 2048], hidden), timeout_s=120)
            _dump(Path(opts.out) / "sim.json", out)
    return out


# ---- parity: TPn against TP1 ------------------------------------------------------------------
def _greedy(model, ids: torch.Tensor, steps: int) -> torch.Tensor:
    for _ in range(steps):
        ids = torch.cat([ids, model(ids)[:, -1].argmax(-1)[:, None]], dim=1)
    return ids


def _parity_rank(group: TPGroup, ckpt: str, kernels: str) -> dict:
    from model.weights import load_model

    if group.size > 1:
        group.boundary_impl = "oneshot"  # NCCL's default; gloo takes its fallback
    dev, prompts = group.device, torch.tensor(PROMPTS, device=group.device)
    out = {}
    m = attach(load_model(ckpt, dtype=torch.float32, device=str(dev), tp=group.size,
                          rank=group.rank, kernels="reference"), group)
    out["fp32_logits"], out["fp32_greedy"] = m(prompts).cpu(), _greedy(m, prompts, NEW_TOKENS).cpu()
    del m
    m = attach(load_model(ckpt, dtype=torch.bfloat16, device=str(dev), tp=group.size,
                          rank=group.rank, kernels=kernels), group)
    out["note"] = group.boundary_note
    out["bf16_logits"], out["bf16_greedy"] = m(prompts).cpu(), _greedy(m, prompts, NEW_TOKENS).cpu()
    if group.size > 1:
        impl, group.boundary_impl = group.boundary_impl, "gather"
        out["bf16_gather_logits"] = m(prompts).cpu()
        group.boundary_impl = impl
        if group.peers is not None:
            group.peers.check()
    return out


def parity_checks(tp1: dict, ranks: list[dict]) -> dict:
    first = ranks[0]
    tp_noise = float((first["bf16_logits"] - tp1["bf16_logits"]).abs().mean())
    bf16_noise = float((tp1["bf16_logits"] - tp1["fp32_logits"]).abs().mean())
    return {
        "ranks_identical": all(torch.equal(r[k], first[k]) for r in ranks
                               for k in ("fp32_logits", "bf16_logits", "bf16_greedy")),
        "fp32_greedy_equal": bool(torch.equal(first["fp32_greedy"], tp1["fp32_greedy"])),
        "fp32_max_abs_logit_diff": float((first["fp32_logits"] - tp1["fp32_logits"]).abs().max()),
        "bf16_oneshot_equals_gather": all(torch.equal(r["bf16_logits"], r["bf16_gather_logits"])
                                          for r in ranks),
        "bf16_tp_noise": tp_noise, "bf16_own_noise": bf16_noise,
        "bf16_noise_within_2x": tp_noise <= 2 * bf16_noise,
        "bf16_greedy_equal": bool(torch.equal(first["bf16_greedy"], tp1["bf16_greedy"])),
        "boundary_note": first["note"],
        "fp32_greedy_tokens": first["fp32_greedy"].tolist(),
    }


def stage_parity(opts) -> dict:
    dev = "cpu" if opts.dry_run else "cuda"
    cfg = parity_config(opts.dry_run)
    t0 = time.monotonic()
    ckpt = str(write_checkpoint(Path(opts.work) / "parity-ckpt", cfg, dev))
    kernels = "reference" if opts.dry_run else "tuned"
    written = time.monotonic() - t0
    tp1 = launch(_parity_rank, 1, opts.backend, args=(ckpt, kernels))[0]
    if dev == "cuda":
        torch.cuda.empty_cache()
    ranks = launch(_parity_rank, opts.tp, opts.backend, args=(ckpt, kernels), timeout_s=300)
    out = {"tp": opts.tp, "config": {k: getattr(cfg, k) for k in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "intermediate_size", "moe_intermediate_size", "num_experts", "vocab_size")},
        "checkpoint_written_s": written, "kernels_bf16": kernels, **parity_checks(tp1, ranks)}
    _dump(Path(opts.out) / "parity.json", out)
    return out


# ---- the driver: each stage in its own process, bounded ------------------------------------------
def _device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return platform.processor() or "cpu"


def _stage_cmd(name: str, opts, out: Path, limit: float) -> list[str] | None:
    """The command of a stage (None: not run in this mode)."""
    py, n, dry = sys.executable, str(opts.tp), ["--dry-run"] if opts.dry_run else []
    me = [py, str(Path(__file__).resolve()), "--gpus", str(opts.gpus), "--work", opts.work, *dry]
    # tp_bench's own bound comes first, so that it stops its ranks and says so.
    bench = [py, str(REPO / "benchmarks" / "tp_bench.py"), "--tp", n, "--timeout",
             str(max(20, int(limit) - 15)), *dry]
    if name == "sim":
        return [*me, "--stage", "sim", "--out", str(out)] if opts.gpus == 1 else None
    if opts.gpus == 1:
        return None
    if name == "parity":
        return [*me, "--stage", "parity", "--out", str(out)]
    if name == "boundary":
        tokens = "1,3" if opts.dry_run else ",".join(map(str, TOKENS))
        return [*bench, "--layers", "2", "--tokens", tokens, "--batches", "0", "--kernels",
                "reference", "--fused", str(FUSED), "--out", str(out / "boundary")]
    if name == "steps":
        layers, batches = ("4", "1,2") if opts.dry_run else ("52", ",".join(map(str, BATCHES)))
        return [*bench, "--layers", layers, "--tokens", "1", "--batches", batches, "--kernels",
                "reference", "--step-kernels", "reference" if opts.dry_run else "tuned",
                "--no-graphs", "--steps", "5", "--out", str(out / "steps")]
    if name == "serve":  # the child's own bound comes first: its generate process is no rank
        return [*me, "--stage", "serve", "--budget", str(max(20, int(limit) - 10)), "--out",
                str(out)]
    if name == "bench_model":
        return _bench_model_cmd(opts, out)
    raise ValueError(f"unknown stage {name!r}; stages: {STAGES}")


def _bench_model_cmd(opts, out: Path) -> list[str] | None:
    cli = [sys.executable, "-m", "autoopt.cli", "bench", "model"]
    try:
        helped = subprocess.run([*cli, "--help"], cwd=REPO, capture_output=True, text=True,
                                timeout=120, env=_env()).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    if "--tp" not in helped:
        return None  # this checkout's bench model has no TP yet
    target = "cpu-tiny" if opts.dry_run else f"h200-tp{opts.tp}-decode"
    batches = "1,2" if opts.dry_run else ",".join(map(str, BATCHES))
    return [*cli, "--target", target, "--tp", str(opts.tp), "--batch", batches,
            "--out", str(out / "bench_model")]


def stage_serve(opts) -> dict:
    """`autoopt generate --tp n` on the 52-layer random-weights directory (rank slices filled
    on the GPUs); a few greedy tokens prove the served path end to end."""
    from model.tp_ranks import write_random_model_dir

    cfg = serve_config(opts.tp, opts.dry_run)
    path = write_random_model_dir(Path(opts.work) / "serve-model", cfg, seed=0)
    dev, dtype = ("cpu", "float32") if opts.dry_run else ("cuda", "bfloat16")
    cmd = [sys.executable, "-m", "autoopt.cli", "generate", "--tp", str(opts.tp), "--model",
           str(path), "--prompt-ids", "7,100,200,300,9", "--max-tokens", "4", "--device", dev,
           "--dtype", dtype, "--json"]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=_env(),
                              timeout=opts.budget)
    except subprocess.TimeoutExpired as exc:  # its ranks watch it and exit with it
        proc = subprocess.CompletedProcess(cmd, "timeout", exc.stdout or "", exc.stderr or "")
        proc.stdout = proc.stdout if isinstance(proc.stdout, str) else proc.stdout.decode()
        proc.stderr = proc.stderr if isinstance(proc.stderr, str) else proc.stderr.decode()
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    out = {"tp": opts.tp, "layers": cfg.num_hidden_layers, "returncode": proc.returncode,
           "seconds": time.monotonic() - t0, "result": json.loads(lines[-1]) if lines else None,
           "stderr_tail": proc.stderr[-3000:]}
    _dump(Path(opts.out) / "serve.json", out)
    return out


def _env() -> dict:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PYTHONUNBUFFERED": "1"}
    env.update(p2p.MULTICAST_OFF)
    if not torch.cuda.is_available():
        env.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run interpreted on CPU
    return env


def run_stage(name: str, opts, out: Path, left_s: float) -> dict:
    limit = min(LIMITS[name], left_s)
    cmd = _stage_cmd(name, opts, out, limit)
    if cmd is None:
        return {"stage": name, "ran": False}
    if limit < 30:
        return {"stage": name, "ran": False, "why": f"only {left_s:.0f} s of the budget left"}
    print(f"== {name} (limit {limit:.0f} s) {time.strftime('%H:%M:%S')}", flush=True)
    t0 = time.monotonic()
    with open(out / f"{name}.log", "w") as log:
        try:
            code = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                  env=_env(), timeout=limit).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
            time.sleep(5)  # its ranks notice their launcher is gone within a second or two
    took = time.monotonic() - t0
    print(f"== {name} exit {code} after {took:.0f} s", flush=True)
    return {"stage": name, "ran": True, "returncode": code, "seconds": took,
            "command": " ".join(cmd[1:])}


# ---- the table ------------------------------------------------------------------------------
def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _results(where: Path) -> dict | None:
    """tp_bench's results, or what its rank 0 had written when the stage was cut short."""
    return _load(where / "tp_bench.json") or _load(where / "tp_bench.partial.json")


def summary(out: Path) -> list[str]:
    lines = []
    sim = _load(out / "sim.json")
    for row in (sim or {}).get("rows", []):
        ok = row["triton_v1_bitwise"] and row["oneshot_stacked_bitwise"] and \
            row["oneshot_ranks_bitwise"]
        us = (f"  v1 {row['triton_v1_us']:.1f} us, oneshot {row['oneshot_stacked_us']:.1f}, "
              f"one rank {row['one_rank_boundary_us']:.1f}" if "triton_v1_us" in row else "")
        lines.append(f"sim      R={row['R']} T={row['T']:<5} bitwise {ok}{us}")
    for ranks, ok in (sim or {}).get("ipc", {}).items():
        lines.append(f"sim      {ranks} processes via CUDA IPC: every call bitwise "
                     f"{all(all(r) for r in ok)}")
    par = _load(out / "parity.json")
    if par:
        lines.append(f"parity   TP{par['tp']} vs TP1: FP32 greedy equal {par['fp32_greedy_equal']}"
                     f" (max |dlogit| {par['fp32_max_abs_logit_diff']:.2e}); BF16 one-shot == "
                     f"gather {par['bf16_oneshot_equals_gather']}, noise {par['bf16_tp_noise']:.3g}"
                     f" vs own {par['bf16_own_noise']:.3g}, greedy equal "
                     f"{par['bf16_greedy_equal']}")
        lines.append(f"parity   {par['boundary_note']}")
    bnd = _results(out / "boundary")
    for row in (bnd or {}).get("boundary", []):
        if row["impl"] in ("allreduce", "gather+fused", "oneshot", "comm:oneshot",
                           "comm:allgather", "comm:allreduce"):
            us, slowest = row.get("median_us"), row.get("max_rank_median_us")
            text = (f"{us:9.1f} us" + (f" (slowest rank {slowest:.1f})" if slowest else "")
                    if us is not None else str(row.get("error"))[:60])
            lines.append(f"boundary T={row['tokens']:<5} {row['mode']:<5} {row['impl']:<14} "
                         f"{text}")
    for row in (bnd or {}).get("verify", []):
        lines.append(f"verify   T={row['tokens']:<5} {row['impl']:<14} bitwise on every rank "
                     f"{row.get('all_ranks_bitwise', str(row['bitwise']) + ' (rank 0)')}")
    steps = _results(out / "steps")
    for row in (steps or {}).get("step", []):
        floor = f"floor {row['floor_ms']:.2f} ms, x{row['x_floor']:.1f}" if row["floor_ms"] \
            else f"comm floor {row['comm_floor_ms']:.2f} ms"
        lines.append(f"step     B={row['batch']:<3} {row['impl']:<10} {row['median_ms']:9.2f} ms"
                     f"  {floor}")
    srv = _load(out / "serve.json")
    if srv:
        ids = (srv.get("result") or {}).get("token_ids")
        lines.append(f"serve    generate --tp {srv['tp']} ({srv['layers']} layers): exit "
                     f"{srv['returncode']}, tokens {ids}, {srv['seconds']:.0f} s")
    return lines


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, choices=(1, 2, 8), default=8,
                    help="GPUs on the machine: 8 (TP8), 2 (TP2) or 1 (the kernel alone)")
    ap.add_argument("--out", default=os.environ.get("OUT", "tp8-out"), help="output directory")
    ap.add_argument("--work", default=None, help="scratch for checkpoints (default OUT/../work)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny shapes")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for all stages")
    ap.add_argument("--stages", default=",".join(STAGES), help="comma list of stages to run")
    ap.add_argument("--stage", default=None, help=argparse.SUPPRESS)  # a child: one stage
    opts = ap.parse_args(argv)
    opts.tp = max(opts.gpus, 2)
    opts.backend = "gloo" if opts.dry_run else "nccl"
    opts.work = opts.work or str(Path(opts.out).resolve().parent / "tp8-work")
    if not opts.dry_run and opts.gpus > 1 and torch.cuda.device_count() < opts.gpus:
        ap.error(f"--gpus {opts.gpus} but {torch.cuda.device_count()} GPU(s) are visible")
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    p2p.disable_multicast()
    if opts.stage is not None:
        {"sim": stage_sim, "parity": stage_parity, "serve": stage_serve}[opts.stage](opts)
        return 0
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    start, runs = time.monotonic(), []
    for name in [s for s in opts.stages.split(",") if s]:
        runs.append(run_stage(name, opts, out, opts.budget - (time.monotonic() - start)))
    result = {"gpus": opts.gpus, "tp": opts.tp, "dry_run": opts.dry_run,
              "device": _device_name(), "gpu_count": torch.cuda.device_count(),
              "torch": torch.__version__, "stages": runs, "env": {
                  k: os.environ.get(k) for k in p2p.MULTICAST_OFF},
              "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    lines = summary(out)
    result["summary"] = lines
    _dump(out / "tp8_run.json", result)
    print("\n".join(lines))
    failed = [r["stage"] for r in runs if r.get("ran") and r.get("returncode") != 0]
    print(f"wrote {out / 'tp8_run.json'}; stages that failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
