"""TP decode of a shard-shaped Beam model: the rank sum + sandwich-norm boundary, unfused/fused.

    python benchmarks/tp_bench.py --out $OUT                  # 2 GPUs, NCCL (spawns the 2 ranks)
    python benchmarks/tp_bench.py --tp 8 --layers 52 --out $OUT   # the TP8 deployment, 8 GPUs
    torchrun --nproc-per-node 2 benchmarks/tp_bench.py --out $OUT
    python benchmarks/tp_bench.py --dry-run --out DIR         # CPU, gloo, tiny shapes (CI)

The model is Beam with random weights filled on each rank's device, sized so that each of the
`--tp` ranks holds exactly one Beam TP8 rank's shard (hidden 5120, 6 query / 1 KV head, dense I
2560, 256 experts of I 320, vocab 18992 per rank): the boundary's volume is the TP8 one; at
--tp 8 --layers 52 it is the deployment itself (~125 GB a rank).
Boundary implementations (model.parallel.BOUNDARIES, plus --fused):
    allreduce     NCCL's in-place all-reduce (BF16) + norm_residual_norm (unfused with the
                  reference ops)
    gather        NCCL all-gather + FP32 rank-order sum + one rounding + reference boundary (the
                  op's reference: model/ops/allreduce_norm_residual_norm.py)
    gather+fused  the same with a fused kernel for the stacked op (--fused FILE exporting `run`)
    oneshot       peer-to-peer loads from buffers exchanged once + one fused kernel (model/p2p.py;
                  on CPU, or without peer access, it is the "gather" path: see boundary_note)
Measured: per-boundary latency at --tokens (eager, and CUDA-graph replay on GPUs), the
communication and compute parts alone, each boundary's outputs vs the gather reference
(bitwise mismatches; docs/numerics.md wants a fused boundary bitwise equal to the unfused one at the
same TP), and whole decode-step times at --batches (eager: the reference MoE loops over experts
on the host, so steps are not graph-capturable yet) against their floor: the per-rank floor
(weights the step reads, its routing's experts and its KV, over this GPU's measured copy
bandwidth) plus the measured communication floor (model/tp_measure.py). Rank 0 writes
tp_bench.json under --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
# Runs from a plain checkout too (the GPU machine may not have `pip install -e .`); spawned ranks
# inherit sys.path.
sys.path.insert(0, str(REPO))

from model.beam import BeamForCausalLM  # noqa: E402
from model.config import BeamConfig, preset  # noqa: E402
from model.ops import OpTable  # noqa: E402
from model.ops import allreduce_norm_residual_norm as arn  # noqa: E402
from model.parallel import BOUNDARIES, TPGroup, attach, launch  # noqa: E402
from model.tp_measure import comm_floor, measure, measure_graph, step_comm_floor_us  # noqa: E402
from model.tp_ranks import random_rank_model  # noqa: E402


# ---- the model --------------------------------------------------------------------------------
def shard_config(tp: int, layers: int, dry_run: bool) -> BeamConfig:
    """Beam scaled so each of `tp` ranks holds one TP8 rank's shard (dry run: the tiny preset)."""
    if dry_run:
        return preset("tiny").replace(num_hidden_layers=layers)
    base = preset("beam-1.0-501b")
    if 8 % tp:
        raise SystemExit(f"--tp {tp} must divide 8 (each rank holds one TP8 shard)")
    k = tp / 8
    return base.replace(
        num_hidden_layers=layers,
        num_attention_heads=int(base.num_attention_heads * k),
        num_key_value_heads=int(base.num_key_value_heads * k),
        intermediate_size=int(base.intermediate_size * k),
        moe_intermediate_size=int(base.moe_intermediate_size * k),
        vocab_size=int(base.vocab_size * k),
    )


def random_model(cfg: BeamConfig, group: TPGroup, seed: int, max_tokens: int,
                 ops: OpTable) -> BeamForCausalLM:
    """Random weights made on the device; replicated tensors equal on every rank. Attaching
    sets up the one-shot boundary's buffers for `max_tokens` tokens (collective)."""
    model = random_rank_model(cfg, group.size, group.rank, group.device, seed=seed, ops=ops)
    return attach(model, group, max_tokens)


class DecodeAttention:
    """Each token is the next one of its own sequence, with `context - 1` cached (random) keys."""

    def __init__(self, cfg: BeamConfig, group: TPGroup, batch: int, context: int) -> None:
        shard = cfg.shard(group.size)
        g = torch.Generator(device=group.device).manual_seed(17 + group.rank)
        shape = (cfg.num_hidden_layers, batch, shard.num_key_value_heads, context - 1,
                 cfg.head_dim)
        self.k = torch.randn(shape, generator=g, device=group.device).to(torch.bfloat16)
        self.v = torch.randn(shape, generator=g, device=group.device).to(torch.bfloat16)

    def kv_cache(self, layer, v, batch):
        # The new token's K/V go to a one-token scratch (pages of 1, slot b = sequence b).
        self.new = (torch.empty_like(v)[:, None], torch.empty_like(v)[:, None])
        return (*self.new, torch.arange(v.shape[0], device=v.device))

    def __call__(self, layer, q, window, scale, batch) -> torch.Tensor:
        b = q.shape[0]  # q [B, Hq, D]; the new k, v [B, Hkv, D] from the scratch
        k, v = self.new[0][:, 0], self.new[1][:, 0]
        keep = window - 1 if window else self.k.shape[3]
        keys = torch.cat([self.k[layer, :b, :, -keep:], k[:, :, None]], dim=2)
        vals = torch.cat([self.v[layer, :b, :, -keep:], v[:, :, None]], dim=2)
        o = F.scaled_dot_product_attention(q[:, :, None], keys, vals, scale=scale,
                                           enable_gqa=True)
        return o[:, :, 0]


# ---- the boundary -----------------------------------------------------------------------------
def base_ops(kernels: str, device: torch.device) -> OpTable:
    """Every op's implementation for the steps: the references, or the registry's selection."""
    if kernels == "reference":
        return OpTable()
    from model.registry import resolve_ops

    return resolve_ops(kernels, device=device)


def implementations(fused: str | None, base: OpTable) -> list[tuple[str, str, OpTable]]:
    """(label, boundary name, op table) for every boundary to compare."""
    impls = [(name, name, base) for name in BOUNDARIES]
    if fused:
        spec = importlib.util.spec_from_file_location("tp_bench_fused", fused)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        table = OpTable({**{n: base.impl(n) for n in base.sources}, arn.NAME: module.run},
                        {**base.sources, arn.NAME: fused})
        impls.append(("gather+fused", "gather", table))
    return impls


def _ulp_line(x: torch.Tensor) -> torch.Tensor:
    i = x.contiguous().view(torch.int16).to(torch.int32)
    return torch.where(i < 0, -(i & 0x7FFF), i)


def _compare(got, want) -> dict:
    mism = sum(int((g.view(torch.int16) != w.view(torch.int16)).sum()) for g, w in zip(got, want))
    ulp = max(int((_ulp_line(g) - _ulp_line(w)).abs().max()) for g, w in zip(got, want))
    return {"mismatches": mism, "numel": sum(w.numel() for w in want), "max_ulp": ulp,
            "bitwise": mism == 0}


def boundary_cases(group: TPGroup, cfg: BeamConfig, impls, tokens: int):
    """Verify every boundary at `tokens`; return the timing cases [(label, fn)], reset, checks."""
    dev = group.device
    shape = {"R": group.size, "T": tokens, "H": cfg.hidden_size}
    partials, residual, post_w, next_w, add_index, eps = arn.make_inputs(shape, seed=tokens,
                                                                         device=dev)
    mine = partials[group.rank].contiguous()
    buf = mine.clone()
    rest = (residual, post_w, next_w, add_index, eps)
    want = arn.reference(partials, *rest)

    def reset() -> None:  # the in-place all-reduce grows its buffer; refilled outside the timing
        buf.copy_(mine)

    cases, checks = [], []
    for label, name, ops in impls:
        group.boundary_impl = name
        reset()
        checks.append({"impl": label, "tokens": tokens,
                       **_compare(group.boundary(ops, buf, *rest), want)})

        def call(name=name, ops=ops):
            group.boundary_impl = name
            return group.boundary(ops, buf, *rest)

        cases.append((label, call))
    group.boundary_impl = "gather"
    if group.size > 1:
        cases.append(("comm:allreduce", lambda: dist.all_reduce(buf, group=group.pg)))
        cases.append(("comm:allgather", lambda: group.gather_partials(mine)))
    if group.peers is not None and group.peers.fits(mine):
        cases.append(("comm:oneshot", lambda: group.peers.all_reduce(mine)))
    gathered = group.gather_partials(mine)
    for label, _, ops in impls:
        if label == "gather" or label.startswith("gather+"):
            cases.append((f"compute:{label}", lambda ops=ops: ops.allreduce_norm_residual_norm(
                gathered, *rest)))
    summed = arn.rank_sum(partials)
    cases.append(("compute:norm_residual_norm",
                  lambda: impls[0][2].norm_residual_norm(summed, *rest)))
    return cases, reset, checks


def time_cases(group: TPGroup, tokens: int, cases, reset, opts, graph: bool) -> list[dict]:
    rows = []
    for label, fn in cases:
        row = {"impl": label, "tokens": tokens, "mode": "graph" if graph else "eager"}
        try:
            if graph:
                row.update(measure_graph(fn, group, opts.repeats, opts.inner, reset))
            else:
                row.update(measure(fn, group, opts.warmup, opts.repeats, opts.inner, reset))
        except Exception as exc:  # reported, not hidden: capturing a collective can fail
            if not graph:
                raise
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
    group.boundary_impl = "gather"
    return rows


# ---- whole decode steps -----------------------------------------------------------------------
def copy_bandwidth(device: torch.device) -> float | None:
    """Bytes/s of an elementwise kernel reading and writing 512 MiB (this GPU's ceiling)."""
    if device.type != "cuda":
        return None
    x = torch.ones(1 << 27, device=device)
    y = torch.empty_like(x)
    stats = measure(lambda: torch.mul(x, 1.0, out=y), _Solo(device), 2, 10, 1)
    return 2 * x.nbytes / (stats["median_us"] * 1e-6)


class _Solo:
    """`measure`'s view of a group when only this rank times (no barrier needed)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def barrier(self) -> None:
        pass


def step_bytes(model, attn: DecodeAttention, step, batch: int) -> dict:
    """Bytes one decode step reads on this rank: its weights (the experts its routing picked,
    the embedding rows of its tokens) and its KV cache (sliding layers: one window)."""
    ops, touched = model.ops, []

    def router(*args):
        weights, ids = ops.router(*args)
        touched.append(int(torch.unique(ids).numel()))
        return weights, ids

    model.set_ops(OpTable({**{n: ops.impl(n) for n in ops.sources}, "router": router},
                          ops.sources))
    step()
    model.set_ops(ops)
    experts = 0
    for layer in model.layers:
        if not layer.dense:
            experts += touched.pop(0) * (layer.experts_gate_up[0].nbytes
                                         + layer.experts_down[0].nbytes)
    dense = sum(b.nbytes for n, b in model.named_buffers()
                if "experts_" not in n and n != "embed_tokens")
    dense += batch * model.embed_tokens[0].nbytes
    cfg = model.config
    keys = sum(min(cfg.window(i) or attn.k.shape[3] + 1, attn.k.shape[3] + 1)
               for i in range(cfg.num_hidden_layers))
    kv = 2 * batch * attn.k.shape[2] * keys * cfg.head_dim * attn.k.element_size()
    return {"weights": dense, "experts": experts, "kv": kv, "total": dense + experts + kv}


def bench_steps(group: TPGroup, cfg: BeamConfig, model, impls, opts, progress) -> list[dict]:
    rows = []
    attn = DecodeAttention(cfg, group, max(opts.batches), opts.context)
    model.attention_backend = attn
    bandwidth = copy_bandwidth(group.device)
    first_logits: dict[int, torch.Tensor] = {}
    for b in opts.batches:
        g = torch.Generator().manual_seed(b)  # same ids on every rank
        ids = torch.randint(0, cfg.vocab_size, (b,), generator=g).to(group.device)
        positions = torch.full((b,), opts.context - 1, device=group.device)

        def step(ids=ids, positions=positions):
            return model.compute_logits(model.forward_tokens(ids, positions, None))

        model.set_ops(impls[0][2])
        floor = _step_floor(group, cfg, model, attn, step, b, bandwidth)
        for label, name, ops in impls:
            if opts.step_impls and label not in opts.step_impls:
                continue
            group.boundary_impl = name
            model.set_ops(ops)
            logits = step()
            first_logits.setdefault(b, logits)
            stats = measure(step, group, opts.step_warmup, opts.steps, 1)
            ms = stats["median_us"] / 1e3
            rows.append({"impl": label, "batch": b, "median_ms": ms,
                         "iqr_ms": stats["iqr_us"] / 1e3, "steps": stats["samples"],
                         "logits_equal_to_first_impl": bool(torch.equal(logits, first_logits[b])),
                         **floor, "x_floor": ms / floor["floor_ms"] if floor["floor_ms"] else None})
            progress(rows)
    if group.peers is not None:
        group.peers.check()
    group.boundary_impl = "gather"
    model.set_ops(OpTable())
    return rows


def _step_floor(group: TPGroup, cfg: BeamConfig, model, attn, step, batch: int,
                bandwidth: float | None) -> dict:
    """Per-rank floor (bytes over the copy bandwidth) + the measured communication floor."""
    group.boundary_impl = "gather"
    read = step_bytes(model, attn, step, batch)
    comm = comm_floor(group, batch, cfg.hidden_size, model.shard.vocab_size)
    comm_ms = step_comm_floor_us(comm, cfg.num_hidden_layers) / 1e3
    rank_ms = read["total"] / bandwidth * 1e3 if bandwidth else None
    return {"bytes_read": read, "rank_floor_ms": rank_ms, "comm_floor_ms": comm_ms,
            "comm": comm, "floor_ms": rank_ms + comm_ms if rank_ms is not None else None,
            "bandwidth_tb_s": bandwidth / 1e12 if bandwidth else None}


# ---- driver -----------------------------------------------------------------------------------
def rank_main(group: TPGroup, opts) -> dict:
    torch.manual_seed(0)
    cfg = shard_config(group.size, opts.layers, opts.dry_run)
    impls = implementations(opts.fused, base_ops(opts.kernels, group.device))
    step_base = base_ops(opts.step_kernels, group.device)
    # Built first: attaching it sets up the one-shot buffers every boundary case can use.
    group.boundary_impl = "oneshot"
    model = random_model(cfg, group, 0, max(max(opts.tokens), max(opts.batches)), step_base)
    boundary, verify, saved = [], [], []

    def progress(steps: list) -> None:  # rank 0 keeps what is done, should the run be cut short
        if group.rank == 0:
            out = Path(opts.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "tp_bench.partial.json").write_text(json.dumps(
                {"boundary": boundary, "verify": verify, "step": steps}, default=str) + "\n")

    for tokens in opts.tokens:
        cases, reset, checks = boundary_cases(group, cfg, impls, tokens)
        verify += checks
        boundary += time_cases(group, tokens, cases, reset, opts, graph=False)
        saved.append((tokens, cases, reset))
        progress([])
    step_impls = [(label, name, step_base) for label, name, _ in impls if label in BOUNDARIES]
    steps = bench_steps(group, cfg, model, step_impls, opts, progress) if opts.batches[0] else []
    model.attention_backend = None
    # CUDA-graph timings last: a capture that fails must not cost the eager results above.
    if group.device.type == "cuda" and not opts.no_graphs:
        for tokens, cases, reset in saved:
            boundary += time_cases(group, tokens, cases, reset, opts, graph=True)
    if group.peers is not None:
        group.peers.check()
    dev = group.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu"
    return {"rank": group.rank, "boundary": boundary, "verify": verify, "step": steps,
            "device": name, "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
            "boundary_note": group.boundary_note,
            "ops_sources": {label: dict(ops.sources) for label, _, ops in impls},
            "step_ops_sources": dict(step_base.sources),
            "config": {k: getattr(cfg, k) for k in (
                "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "intermediate_size", "moe_intermediate_size", "num_experts", "vocab_size")},
            "shard": vars(cfg.shard(group.size))}


def _meta(opts, ranks: list[dict]) -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    nccl = None
    if torch.cuda.is_available():
        version = torch.cuda.nccl.version()
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return {"devices": [r["device"] for r in ranks], "tp": opts.tp, "backend": opts.backend,
            "dry_run": opts.dry_run, "torch": torch.__version__, "triton": triton_version,
            "nccl": nccl, "python": platform.python_version(), "git_commit": commit,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": ranks[0]["config"],
            "shard_per_rank": ranks[0]["shard"], "boundaries_per_step": 2 * opts.layers,
            "context": opts.context, "inner_calls": opts.inner, "repeats": opts.repeats,
            "nccl_nvls_enable": ranks[0]["nccl_nvls_enable"], "kernels": opts.kernels,
            "step_kernels": opts.step_kernels, "ops_sources": ranks[0]["ops_sources"],
            "step_ops_sources": ranks[0]["step_ops_sources"],
            "boundary_note": ranks[0]["boundary_note"]}


def merge(opts, ranks: list[dict]) -> dict:
    """Rank 0's rows, each boundary row with the slowest rank's median next to it."""
    boundary = []
    for i, row in enumerate(ranks[0]["boundary"]):
        medians = [r["boundary"][i].get("median_us") for r in ranks]
        boundary.append({**row, "max_rank_median_us": None if None in medians else max(medians)})
    verify = [{**row, "all_ranks_bitwise": all(r["verify"][i]["bitwise"] for r in ranks)}
              for i, row in enumerate(ranks[0]["verify"])]
    return {"meta": _meta(opts, ranks), "boundary": boundary, "verify": verify,
            "step": ranks[0]["step"]}


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench-out"), help="output directory")
    ap.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny shapes, few iterations")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 6; dry 4)")
    ap.add_argument("--fused", default=None, help="variant file exporting run(partials, ...)")
    ap.add_argument("--kernels", default="reference",
                    help="ops for the boundary cases: reference, tuned, or a registry lock file")
    ap.add_argument("--step-kernels", default=None,
                    help="ops for the whole steps (default: --kernels)")
    ap.add_argument("--tokens", default=None, help="boundary token counts (default 1,8,64,2048)")
    ap.add_argument("--batches", default=None,
                    help="decode batch sizes, 0 for none (default 1,8,32,64)")
    ap.add_argument("--step-impls", default=None,
                    help="boundaries to time whole steps with (default: all registered)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per row (default 10)")
    ap.add_argument("--context", type=int, default=None, help="cached keys per sequence")
    ap.add_argument("--no-graphs", action="store_true", help="skip CUDA-graph boundary timings")
    ap.add_argument("--timeout", type=float, default=300.0, help="whole-run bound, seconds")
    opts = ap.parse_args(argv)
    dry = opts.dry_run
    opts.backend = "gloo" if dry or not torch.cuda.is_available() else "nccl"
    opts.layers = opts.layers or (4 if dry else 6)
    opts.context = opts.context or (32 if dry else 1024)
    opts.tokens = _ints(opts.tokens or ("1,17" if dry else "1,8,64,2048"))
    opts.batches = _ints(opts.batches or ("1,2" if dry else "1,8,32,64"))
    opts.step_kernels = opts.step_kernels or opts.kernels
    opts.step_impls = [x for x in (opts.step_impls or "").split(",") if x]
    opts.warmup, opts.repeats, opts.inner = (1, 3, 2) if dry else (10, 30, 20)
    opts.step_warmup, opts.steps = (1, 2) if dry else (2, opts.steps or 10)
    return opts


def summary(result: dict) -> str:
    lines = [f"devices: {result['meta']['devices']}  tp={result['meta']['tp']}"]
    for row in result["boundary"]:
        us = row.get("median_us")
        text = f"{us:10.1f} us  iqr {row['iqr_us']:.1f}" if us is not None else row.get("error")
        lines.append(f"boundary T={row['tokens']:<5} {row['mode']:<5} {row['impl']:<28} {text}")
    for row in result["verify"]:
        lines.append(f"verify   T={row['tokens']:<5} {row['impl']:<28} mismatches "
                     f"{row['mismatches']}/{row['numel']} max_ulp {row['max_ulp']}")
    for row in result["step"]:
        floor = (f"floor {row['floor_ms']:.2f} ms (rank {row['rank_floor_ms']:.2f} + comm "
                 f"{row['comm_floor_ms']:.2f}), x{row['x_floor']:.1f}" if row["floor_ms"]
                 else f"comm floor {row['comm_floor_ms']:.2f} ms")
        lines.append(f"step     B={row['batch']:<5} {row['impl']:<28} {row['median_ms']:8.2f} ms "
                     f"iqr {row['iqr_ms']:.2f}  {floor}")
    lines.append(f"boundary note: {result['meta']['boundary_note']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    opts = parse(argv)
    # A collective stuck for 120 s raises (rather than eating the whole run's time budget).
    ranks = launch(rank_main, opts.tp, backend=opts.backend, args=(opts,),
                   timeout_s=opts.timeout, pg_timeout_s=120.0)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # under torchrun every rank has the results; rank 0 writes them
    result = merge(opts, ranks)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tp_bench.json").write_text(json.dumps(result, indent=2) + "\n")
    print(summary(result))
    print(f"wrote {out / 'tp_bench.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
