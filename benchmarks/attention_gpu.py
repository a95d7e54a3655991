"""The attention block on one GPU: correctness against the references and time under CUDA graphs.

On one H200 (under 5 minutes; `--budget-s` bounds it):
    python benchmarks/attention_gpu.py --out $OUT
measures, at Beam's TP8 rank shapes (H=5120, Hq=6, Hkv=1, D=128, pages of 16):
  1. decode attention per layer, contexts 1k/8k/32k/128k x batch 1/8/32/64, full-attention and
     sliding-window (512) layers: the torch reference path, attention/triton_v1 and, where
     flashinfer imports, attention/flashinfer_v1 (its decode kernel JIT-compiles once, ~20-35 s,
     into FlashInfer's cache; `--no-flashinfer` skips it). Each against the reference: max ulp,
     mismatch fraction, and mismatches against the reference and the fp32_probs near miss (a
     kernel at the eager rounding points is far closer to the reference). Every row's pages are
     its own, scattered over the pool, so nothing is served from L2 by sharing.
  2. qkv_gate_proj at T = 1..64: cuBLAS (the reference), triton_v1 (tensor-core split-K GEMV)
     and triton_v2 (multiply-reduce GEMV), each at the fastest of a config sweep for T <= 16,
     against the HBM floor of the weight stream; gated_o_proj the same way: the torch
     gate then cuBLAS (the reference), attn_output_gate/triton_v2 then cuBLAS, and the fused
     template_splitk_v1.
  3. qk_norm_rope / qk_norm_ssmax with the KV write: the reference and template_rows_v2.
  4. kernels launched by one attention block at bs 1 (qkv_gate_proj .. o_proj, through the
     serving runtime's paged backend), reference ops vs the block's variants.
Times are medians of CUDA-graph replays of 20 back-to-back calls. Writes $OUT/attention_gpu.json
and $OUT/attention_gpu.md, then prints the short table. `--dry-run` runs the same code on the CPU
with tiny shapes (interpreter; eager timings, not meaningful) to check it.

`--quick` (about 70 s on an H200, no FlashInfer): only decode attention, contexts 1k/8k/128k x
batch 1/8/64 on both layer kinds, torch vs triton_v1 (correctness and CUDA-graph time), then a
sweep of triton_v1's split/block configs at batch 1 and 8 (full layer at each context, window
layer at 8k), each config checked against the reference; the fastest correct config per bucket
goes to `best_configs` in the JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from model.ops import OpTable, contract  # noqa: E402
from model.registry import Registry  # noqa: E402

GPU = SimpleNamespace(contexts=(1024, 8192, 32768, 131072), batches=(1, 8, 32, 64),
                      tokens=(1, 2, 4, 8, 16, 32, 64), H=5120, Hq=6, Hkv=1, D=128, page=16,
                      window=512, pages=4096)
DRY = SimpleNamespace(contexts=(40, 70), batches=(1, 3), tokens=(1, 3, 17), H=256, Hq=6, Hkv=1,
                      D=128, page=16, window=16, pages=8)
QUICK = SimpleNamespace(**{**vars(GPU), "contexts": (1024, 8192, 131072), "batches": (1, 8, 64)})
DRY_QUICK = SimpleNamespace(**{**vars(DRY), "contexts": (40, 300), "batches": (1, 3)})
# triton_v1 configs swept by --quick at batch 1 and 8 (most telling first: the budget may cut
# the tail). SPLITS 0 is the variant's automatic split count.
ATTN_SWEEP = [
    {"SPLITS": 0, "BLOCK_N": 64, "MIN_BLOCKS": 2, "GROUP": 8, "num_warps": 4},
    {"SPLITS": 0, "BLOCK_N": 64, "MIN_BLOCKS": 1, "GROUP": 8, "num_warps": 4},
    {"SPLITS": 0, "BLOCK_N": 128, "MIN_BLOCKS": 1, "GROUP": 8, "num_warps": 8},
    {"SPLITS": 0, "BLOCK_N": 64, "MIN_BLOCKS": 4, "GROUP": 8, "num_warps": 4},
    {"SPLITS": 256, "BLOCK_N": 64, "MIN_BLOCKS": 2, "GROUP": 16, "num_warps": 4},
    {"SPLITS": 0, "BLOCK_N": 32, "MIN_BLOCKS": 2, "GROUP": 8, "num_warps": 4},
    {"SPLITS": 0, "BLOCK_N": 128, "MIN_BLOCKS": 2, "GROUP": 8, "num_warps": 8},
    {"SPLITS": 1, "BLOCK_N": 64, "MIN_BLOCKS": 1, "GROUP": 8, "num_warps": 4},
]
DRY_SWEEP = [{"SPLITS": 0, "BLOCK_N": 16, "MIN_BLOCKS": 1, "GROUP": 2, "num_warps": 4},
             {"SPLITS": 1, "BLOCK_N": 32, "MIN_BLOCKS": 1, "GROUP": 8, "num_warps": 4}]
QKV_SWEEP = [{"BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 2, "num_warps": 4},
             {"BLOCK_N": 32, "BLOCK_K": 512, "SPLIT_K": 4, "num_warps": 4},
             {"BLOCK_N": 32, "BLOCK_K": 512, "SPLIT_K": 2, "num_warps": 4}]
# triton_v2 (multiply-reduce): a few programs a SM with their whole K range, or many with one
# load step each (SPLIT_K); {} is the default (the library above 8 tokens), the others set
# GEMV_MAX_T 16 so that every T <= 16 runs the kernel. Every config
# compiles once per T class: the list is short so that the section stays within ~2 minutes.
QKV2_SWEEP = [{}] + [{"BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": sk, "num_warps": w, "GEMV_MAX_T": 16}
              for n, k, sk, w in ((2, 1024, 1, 4), (4, 1024, 1, 4), (8, 1024, 5, 4),
                                  (16, 1024, 5, 4), (4, 512, 10, 4), (16, 512, 10, 4),
                                  (32, 512, 10, 8), (16, 1024, 5, 8))]
GATED_SWEEP = [{"BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": s, "num_warps": 4}
               for n in (16, 32) for k in (128, 256) for s in (1, 2, 3)]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="Output directory.")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: check the logic.")
    p.add_argument("--budget-s", type=float, default=None,
                   help="Stop starting new attention cases after this many seconds (default "
                        "270; 65 with --quick, of which the cases take 55%%, the sweep the "
                        "rest).")
    p.add_argument("--no-flashinfer", action="store_true", help="Skip FlashInfer.")
    p.add_argument("--sections", default=None,
                   help="Comma-separated sections to run (default all): kernels_per_block, qkv, "
                        "attention, gated_o_proj, qk_norm.")
    p.add_argument("--quick", action="store_true",
                   help="Decode attention only (1k/8k/128k x bs 1/8/64), no FlashInfer, plus a "
                        "triton_v1 config sweep at bs 1 and 8 (~70 s).")
    return p.parse_args(argv)


# ---- timing and comparison ------------------------------------------------------------------
def timed(fn, device: torch.device, calls: int = 20, reps: int = 7) -> float:
    """Median µs per call: CUDA-graph replays of `calls` back-to-back calls (eager on CPU)."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    samples = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(samples)


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    ia = torch.where(ia < 0, -(ia & 0x7FFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFF), ib)
    return (ia - ib).abs()


def compare(got, ref, near=None, magnitude=None) -> dict:
    """Max ulp and mismatch fraction; with `magnitude`, ulps at max(|ref|, magnitude), as the
    op's verifier counts them (sums whose terms cancel)."""
    from autoopt.eval.numerics import ulp_diff_at

    d = ulps(got, ref) if magnitude is None else ulp_diff_at(got, ref, magnitude).abs()
    row = {"max_ulp": int(d.max()), "mismatch": float((d > 0).float().mean())}
    if near is not None:
        row["vs_ref"], row["vs_near"] = int((got != ref).sum()), int((got != near).sum())
    return row


def hbm_bytes_per_s(device: torch.device) -> float:
    if device.type != "cuda":
        return 1e11
    x = torch.empty(256 << 20, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    us = timed(lambda: torch.neg(x, out=y), device, calls=5, reps=5)
    return 2 * x.numel() * 4 / (us * 1e-6)


# ---- decode attention -------------------------------------------------------------------------
def decode_case(ctx: int, batch: int, window: int, s, device, gen) -> tuple:
    """The attention contract's inputs for `batch` decodes at position ctx - 1, each row in its
    own scattered pages (window layers: the pages from the window's first key)."""
    page = s.page
    base = (max(0, ctx - window) // page) * page if window else 0
    per_row = -(-(ctx - base) // page)
    pool = 1 + batch * per_row
    perm = torch.randperm(pool - 1, device=device, generator=gen) + 1
    table = perm.view(batch, per_row).long()
    shape = (pool, page, s.Hkv, s.D)
    k = torch.randn(shape, device=device, generator=gen).to(torch.bfloat16)
    v = torch.randn(shape, device=device, generator=gen).to(torch.bfloat16)
    q = torch.randn(batch, s.Hq, s.D, device=device, generator=gen).to(torch.bfloat16)
    long = dict(dtype=torch.long, device=device)
    return (q, k, v, table, torch.full((batch,), base, **long), torch.arange(batch, **long),
            torch.full((batch,), ctx - 1, **long), window, s.D**-0.5)


def attention_impls(device, use_flashinfer: bool) -> tuple[dict, list[str]]:
    reg, notes = Registry(), []
    impls = {"torch": contract("attention").reference,
             "triton_v1": reg.load_variant("attention", "triton_v1").run}
    if device.type == "cuda" and use_flashinfer:
        fi = reg.load_variant("attention", "flashinfer_v1")
        try:
            fi._flashinfer()
            impls["flashinfer_v1"] = fi
        except RuntimeError as exc:
            notes.append(f"flashinfer skipped: {exc}")
    return impls, notes


def attention_rows(s, device, args, t0: float) -> tuple[list[dict], list[str]]:
    impls, notes = attention_impls(device, not args.no_flashinfer)
    near = contract("attention").numerics.near_misses["fp32_probs"]
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for window in (0, s.window):
        for ctx in s.contexts:
            for batch in s.batches:
                if time.monotonic() - t0 > args.budget_s:
                    notes.append(f"budget reached: stopped before ctx {ctx} batch {batch}")
                    return rows, notes
                rows.append(attention_case(impls, near, ctx, batch, window, s, device, gen))
                print(f"[{time.monotonic() - t0:6.0f} s] attention window {window} ctx {ctx} "
                      f"bs {batch}: " + ", ".join(
                          f"{k} {v['us']:.1f} us" if "us" in v else f"{k} error"
                          for k, v in rows[-1].items() if isinstance(v, dict)), flush=True)
    return rows, notes


def attention_case(impls, near, ctx, batch, window, s, device, gen) -> dict:
    case = decode_case(ctx, batch, window, s, device, gen)
    ref = impls["torch"](*case)
    near_out = near(*case)
    mag = contract("attention").numerics.magnitude(*case)
    row = {"layer": "window" if window else "full", "context": ctx, "batch": batch}
    for name, impl in impls.items():
        try:
            if name == "flashinfer_v1":  # planned once, outside the graph
                fn = impl.plan(tuple(case[0].shape), *case[1:], graph=device.type == "cuda")
                call = (lambda fn=fn, q=case[0]: fn(q))
            else:
                call = (lambda impl=impl, a=case: impl(*a))
            out = call()
            row[name] = {"us": timed(call, device), **compare(out, ref, near_out, mag)}
            row[name]["ok"] = within_policy(row[name])
        except Exception as exc:  # reported in the table, never hidden
            row[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    del case
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def within_policy(m: dict) -> bool:
    pol = contract("attention").numerics
    return m["max_ulp"] <= pol.max_ulp and m["mismatch"] <= pol.max_mismatch_fraction


def sweep_buckets(s) -> list[tuple[int, int]]:
    """(window, context) buckets of the sweep: the full layer at each context, the window layer
    (512 keys whatever the context) once."""
    mid = s.contexts[len(s.contexts) // 2]
    return [(0, ctx) for ctx in s.contexts] + [(s.window, mid)]


def config_sweep(s, device, configs: list[dict], deadline: float) -> tuple[list[dict], dict]:
    """triton_v1 under each config at batch 1 and 8 in each bucket: time and numerics against
    the reference; the fastest within the op's policy per bucket. Config-major, so a budget cut
    leaves the first configs measured everywhere."""
    run = Registry().load_variant("attention", "triton_v1").run
    c = contract("attention")
    gen = torch.Generator(device=device).manual_seed(1)
    cases = {}
    for window, ctx in sweep_buckets(s):
        for batch in (1, 8):
            case = decode_case(ctx, batch, window, s, device, gen)
            cases[("window" if window else "full", ctx, batch)] = (
                case, c.reference(*case), c.numerics.magnitude(*case))
    rows = []
    for cfg in configs:
        for (layer, ctx, batch), (case, ref, mag) in cases.items():
            if time.monotonic() > deadline:
                return rows, best_configs(rows)
            row = {"layer": layer, "context": ctx, "batch": batch, "config": cfg}
            try:
                call = (lambda a=case, cfg=cfg: run(*a, config=cfg))
                row.update(compare(call(), ref, None, mag), us=timed(call, device))
                row["ok"] = within_policy(row)
            except Exception as exc:  # reported, never hidden
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
    return rows, best_configs(rows)


def best_configs(rows: list[dict]) -> dict:
    best: dict[str, dict] = {}
    for r in rows:
        key = f"{r['layer']} ctx {r['context']} bs {r['batch']}"
        if r.get("ok") and (key not in best or r["us"] < best[key]["us"]):
            best[key] = {"layer": r["layer"], "context": r["context"], "batch": r["batch"],
                         "config": r["config"], "us": r["us"], "max_ulp": r["max_ulp"]}
    return best


# ---- qkv_gate_proj and the Q/K norms ------------------------------------------------------------
def gemm_rows(op: str, variants: dict[str, list[dict]], s, device, bw: float,
              extra: dict | None = None) -> list[dict]:
    """A GEMM-shaped op at T = s.tokens: the reference, `extra` callables (label -> fn) and each
    variant (its best config of its sweep where its GEMV path runs: row[name] holds the time,
    config and comparison with the reference), against the HBM floor."""
    c = contract(op)
    mods = {name: Registry().load_variant(op, name) for name in variants}
    flat = (lambda out: torch.cat([o.flatten() for o in out]) if isinstance(out, tuple)
            else out.flatten())
    rows = []
    for t in s.tokens:
        shape = {"T": t, "H": s.H, "Hq": s.Hq, "Hkv": s.Hkv, "D": s.D}
        args = c.make_inputs(shape, t, device)
        ref = c.reference(*args)
        row = {"T": t, "floor_us": c.cost(shape).bytes / bw * 1e6,
               "torch_us": timed(lambda a=args: c.reference(*a), device)}
        for label, fn in (extra or {}).items():
            row[f"{label}_us"] = timed(lambda a=args, fn=fn: fn(*a), device)
        for name, mod in mods.items():
            gemv = t <= getattr(mod, "GEMV_MAX_TOKENS", 16) and device.type == "cuda"
            best = None
            for cfg in variants[name] if gemv else [None]:
                try:
                    us = timed(lambda a=args, cfg=cfg, m=mod: m.run(*a, config=cfg), device)
                except Exception as e:  # noqa: BLE001 - a config that does not compile: skip it
                    row.setdefault("errors", []).append(f"{name} {cfg}: {str(e)[:200]}")
                    continue
                if best is None or us < best[0]:
                    best = (us, cfg)
            if best is None:
                row[name] = {"error": "no config ran"}
                continue
            got = mod.run(*args, config=best[1])
            row[name] = {"us": best[0], "config": best[1],
                         **compare(flat(got), flat(ref), None, flat(c.numerics.magnitude(*args)))}
        rows.append(row)
        print(f"{op} T={t}: floor {row['floor_us']:.1f} us, torch {row['torch_us']:.1f} us, "
              + ", ".join(f"{n} {row[n]['us']:.1f} us {row[n]['config']}" for n in mods
                          if "us" in row[n]), flush=True)
    return rows


def qkv_rows(s, device, bw: float) -> list[dict]:
    return gemm_rows("qkv_gate_proj", {"triton_v1": QKV_SWEEP, "triton_v2": QKV2_SWEEP}, s,
                     device, bw)


def gated_rows(s, device, bw: float) -> list[dict]:
    """gated_o_proj: the reference (torch gate, cuBLAS), the locked gate kernel then cuBLAS (what
    the tuned set runs without a fused variant) and the fused template."""
    gate = Registry().load_variant("attn_output_gate", "triton_v2").run
    composed = contract("gated_o_proj").compose({"attn_output_gate": gate})
    return gemm_rows("gated_o_proj", {"template_splitk_v1": GATED_SWEEP}, s, device, bw,
                     {"gate_kernel_cublas": composed})


def qk_norm_rows(s, device) -> list[dict]:
    reg, rows = Registry(), []
    for op in ("qk_norm_rope", "qk_norm_ssmax"):
        c = contract(op)
        mod = reg.load_variant(op, "template_rows_v2")
        for t in s.tokens:
            shape = {"T": t, "Hq": s.Hq, "Hkv": s.Hkv, "D": s.D, "page": s.page, "P": s.pages}
            args = c.make_inputs(shape, t, device)
            fresh = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            ref, got = c.reference(*fresh), mod.run(*args)
            slots = args[-1]
            v_ok = torch.equal(got[2].flatten(0, 1)[slots], ref[2].flatten(0, 1)[slots])
            row = {"op": op, "T": t,
                   "torch_us": timed(lambda a=args, f=c.reference: f(*a), device),
                   "triton_us": timed(lambda a=args, f=mod.run: f(*a), device),
                   "q": compare(got[0], ref[0]), "k_cache": compare(got[1], ref[1]),
                   "v_cache_bitwise": v_ok}
            rows.append(row)
    return rows


# ---- kernels per attention block ---------------------------------------------------------------
def block_ops() -> OpTable:
    reg = Registry()
    return OpTable({"qkv_gate_proj": reg.load_variant("qkv_gate_proj", "triton_v2").run,
                    "qk_norm_rope": reg.load_variant("qk_norm_rope", "template_rows_v2").run,
                    "qk_norm_ssmax": reg.load_variant("qk_norm_ssmax", "template_rows_v2").run,
                    "attention": reg.load_variant("attention", "triton_v1").run,
                    "attn_output_gate": reg.load_variant("attn_output_gate", "triton_v2").run,
                    "gated_o_proj": reg.load_variant("gated_o_proj", "template_splitk_v1").run})


def block_kernels(s, device) -> dict:
    """Kernels one attention block launches at bs 1 (a full and a window layer), 4k context."""
    from model.beam import BeamForCausalLM
    from model.ops.qk_norm_rope import inv_freq, rope_tables
    from model.serve.engine.kv_cache import KVLayout, PagedKVCache
    from model.serve.paged_attention import PagedAttention, PagedBatch, PoolMeta

    # What attention_block reads of the config: layer 0 sliding-window, layer 1 full.
    cfg = SimpleNamespace(rms_norm_eps=1e-6, head_dim=s.D,
                          window=lambda i: s.window if i == 0 else None)
    shard = SimpleNamespace(num_attention_heads=s.Hq, num_key_value_heads=s.Hkv)
    layout = KVLayout((1,), (0,), s.window, s.page, s.Hkv, s.D, torch.bfloat16)
    cache = PagedKVCache(layout, 300, 300, device)
    ctx, bf = 4096 if device.type == "cuda" else 40, dict(dtype=torch.bfloat16, device=device)
    long = dict(dtype=torch.long, device=device)
    pages = torch.arange(1, 1 + -(-ctx // s.page), **long)[None]
    pool = PoolMeta(pages, torch.zeros(1, **long), torch.tensor([ctx - 1], **long))
    batch = PagedBatch(torch.tensor([ctx - 1], **long), [(0, 1)], torch.zeros(1, **long),
                       {"full": pool, "swa": pool}, 1)
    n = (2 * s.Hq + 2 * s.Hkv) * s.D
    layer = SimpleNamespace(qkv_gate_weight=torch.randn(n, s.H, **bf) * s.H**-0.5,
                            q_norm=torch.ones(s.D, **bf), k_norm=torch.ones(s.D, **bf),
                            gate_bias=torch.zeros(s.Hq, **bf),
                            o_proj=torch.randn(s.H, s.Hq * s.D, **bf) * 0.03, sliding=True)
    x = torch.randn(1, s.H, **bf)
    cos, sin = rope_tables(batch.positions, inv_freq(s.D, 10000.0))
    out = {}
    for label, ops in (("reference", OpTable()), ("variants", block_ops())):
        me = SimpleNamespace(config=cfg, ops=ops, shard=shard,
                             attention_backend=PagedAttention(cache, lambda ops=ops: ops))
        for i, kind in ((0, "window"), (1, "full")):
            layer.sliding = kind == "window"
            call = (lambda me=me, i=i: BeamForCausalLM.attention_block(
                me, i, layer, x, batch.positions, cos, sin, batch))
            out[f"{label} {kind}"] = count_kernels(call, device)
    return out


def count_kernels(call, device) -> int | None:
    if device.type != "cuda":
        call()
        return None  # the CPU has no kernels to count
    from torch.profiler import ProfilerActivity, profile

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA"
               and "memcpy" not in e.name.lower())


# ---- report -------------------------------------------------------------------------------------
def markdown(res: dict) -> str:
    out = ["# Attention block on " + res["env"]["device"], "",
           "Decode attention per layer (µs, CUDA-graph replay; max ulp / mismatch vs reference):",
           "", "| layer | context | batch | impl | µs | max ulp | mismatch | vs ref | "
           "vs fp32_probs |", "|---|---|---|---|---|---|---|---|---|"]
    for r in res.get("attention", []):
        for impl in ("torch", "triton_v1", "flashinfer_v1"):
            if impl in r:
                m = r[impl]
                out.append(f"| {r['layer']} | {r['context']} | {r['batch']} | {impl} | "
                           + (f"{m['us']:.1f} | {m['max_ulp']} | {m['mismatch']:.4f} | "
                              f"{m['vs_ref']} | {m['vs_near']} |" if "us" in m
                              else f"{m['error']} | | | | |"))
    if "sweep" in res:
        out += ["", "triton_v1 config sweep (µs; ok = within the op's policy):", "",
                "| layer | context | batch | config | µs | max ulp | ok |",
                "|---|---|---|---|---|---|---|"]
        out += [f"| {r['layer']} | {r['context']} | {r['batch']} | {r['config']} | "
                + (f"{r['us']:.1f} | {r['max_ulp']} | {r['ok']} |" if "us" in r
                   else f"{r['error']} | | |") for r in res["sweep"]]
        out += ["", "Best config per bucket:", "",
                *[f"- {k}: {v['us']:.1f} µs {v['config']}" for k, v in res["best_configs"].items()]]
    if "qkv" in res:
        out += block_markdown(res)
    out += ["", *[f"- {n}" for n in res["notes"]]]
    return "\n".join(out) + "\n"


def _us(m: dict) -> str:
    return f"{m['us']:.1f}" if "us" in m else "error"


def block_markdown(res: dict) -> list[str]:
    out = ["", "qkv_gate_proj (µs; floor: the weight stream at the measured copy rate; each "
           "variant at its fastest config):", "",
           "| T | floor | cuBLAS | triton_v1 | triton_v2 | v2 x floor | max ulp v1/v2 | "
           "triton_v2 config |", "|---|---|---|---|---|---|---|---|"]
    for r in res["qkv"]:
        v1, v2 = r.get("triton_v1", {}), r.get("triton_v2", {})
        ratio = f"{v2['us'] / r['floor_us']:.2f}" if "us" in v2 else ""
        out.append(f"| {r['T']} | {r['floor_us']:.1f} | {r['torch_us']:.1f} | {_us(v1)} | "
                   f"{_us(v2)} | {ratio} | {v1.get('max_ulp')}/{v2.get('max_ulp')} | "
                   f"{v2.get('config')} |")
    out += ["", "gated_o_proj (µs; the output gate and o_proj; floor: the weight stream):", "",
            "| T | floor | torch gate + cuBLAS | gate kernel + cuBLAS | template_splitk_v1 | "
            "max ulp | config |", "|---|---|---|---|---|---|---|"]
    for r in res.get("gated_o_proj", []):
        m = r.get("template_splitk_v1", {})
        out.append(f"| {r['T']} | {r['floor_us']:.1f} | {r['torch_us']:.1f} | "
                   f"{r['gate_kernel_cublas_us']:.1f} | {_us(m)} | {m.get('max_ulp')} | "
                   f"{m.get('config')} |")
    out += ["", "Q/K norm with the KV write (µs):", "",
            "| op | T | torch | template_rows_v2 | q max ulp | k max ulp | v bitwise |",
            "|---|---|---|---|---|---|---|"]
    out += [f"| {r['op']} | {r['T']} | {r['torch_us']:.1f} | {r['triton_us']:.1f} | "
            f"{r['q']['max_ulp']} | {r['k_cache']['max_ulp']} | {r['v_cache_bitwise']} |"
            for r in res.get("qk_norm", [])]
    return out + ["", "Kernels per attention block at bs 1: "
                  + json.dumps(res.get("kernels_per_block"))]


def measure(args, device, t0: float, save=lambda res: None) -> dict:
    """The whole run (--quick: decode attention and the config sweep only); `save(res)` after
    each section, so that a run cut short keeps what finished."""
    cpu = device.type == "cpu"
    s = (DRY_QUICK if cpu else QUICK) if args.quick else (DRY if cpu else GPU)
    name = torch.cuda.get_device_name(device) if not cpu else "cpu (dry run)"
    res = {"env": {"device": name, "torch": torch.__version__, "meaningful": not cpu,
                   "quick": args.quick}, "notes": []}
    if args.budget_s is None:
        args.budget_s = 65.0 if args.quick else 270.0
    if args.quick:
        args.no_flashinfer = True
        rows_budget = SimpleNamespace(**{**vars(args), "budget_s": 0.55 * args.budget_s})
        res["attention"], notes = attention_rows(s, device, rows_budget, t0)
        res["sweep"], res["best_configs"] = config_sweep(
            s, device, DRY_SWEEP if cpu else ATTN_SWEEP, t0 + args.budget_s)
        res["notes"] += notes
        return res
    bw = hbm_bytes_per_s(device)
    res["env"]["copy_bytes_per_s"] = bw
    sections = (("kernels_per_block", lambda: block_kernels(s, device)),
                ("qkv", lambda: qkv_rows(s, device, bw)),
                ("attention", lambda: attention_rows(s, device, args, t0)),
                ("gated_o_proj", lambda: gated_rows(s, device, bw)),
                ("qk_norm", lambda: qk_norm_rows(s, device)))
    wanted = set(args.sections.split(",")) if args.sections else {k for k, _ in sections}
    unknown = wanted - {k for k, _ in sections}
    if unknown:
        raise SystemExit(f"unknown sections {sorted(unknown)}")
    for key, section in sections:
        if key not in wanted:
            continue
        started = time.monotonic()
        res[key] = section()
        if key == "attention":
            res[key], notes = res[key]
            res["notes"] += notes
        print(f"[{time.monotonic() - t0:6.0f} s] {key}: {time.monotonic() - started:.0f} s",
              flush=True)
        save(res)
    return res


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    device = torch.device("cpu" if args.dry_run or not torch.cuda.is_available() else "cuda")
    args.out.mkdir(parents=True, exist_ok=True)

    def save(res: dict) -> None:
        (args.out / "attention_gpu.json").write_text(json.dumps(res, indent=2, default=str))
        if "qkv" in res or "attention" in res:
            (args.out / "attention_gpu.md").write_text(markdown(res))

    res = measure(args, device, t0, save)
    res["notes"].append(f"elapsed {time.monotonic() - t0:.0f} s")
    save(res)
    short = [f"{r['layer']:6} ctx {r['context']:>6} bs {r['batch']:>2}: " + "  ".join(
        f"{k} {r[k]['us']:.1f}us/{r[k]['max_ulp']}ulp" if "us" in r[k] else f"{k} error"
        for k in ("torch", "triton_v1", "flashinfer_v1") if k in r)
        for r in res.get("attention", [])]
    if "best_configs" in res:
        short += [f"best {k}: {v['us']:.1f}us {v['config']}"
                  for k, v in res["best_configs"].items()]
    if res.get("kernels_per_block"):
        short.append(f"kernels per block: {res['kernels_per_block']}")
    print("\n".join(short + res["notes"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
