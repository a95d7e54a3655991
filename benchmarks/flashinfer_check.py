"""FlashInfer attention backend on a GPU: JIT, agreement with the torch backend, decode timing.

    python benchmarks/flashinfer_check.py --out DIR [--budget-s 270]

1. JIT-compiles FlashInfer's kernels for Beam's TP8 per-rank attention (6 query heads, 1 KV head,
   head_dim 128, BF16, page 16; one module serves full and window-512 layers) and times it.
2. Compares `FlashInferAttention` to `PagedAttention` (torch) and to FP64 attention on random
   paged caches: decode batches and prefill chunks, both pools (full, window 512).
3. Times one layer's decode attention (K/V write + attention) torch vs FlashInfer over contexts
   1k..32k and batches 1..64 (CUDA events, median), while the budget lasts.
Writes DIR/flashinfer_check.json and DIR/flashinfer_check.md. The harness (random caches, steps
laid out by the runner's own `prepare`, FP64 attention) is shared with
tests/test_serve_flashinfer.py.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from model.ops.attention import reference as attention_ref  # noqa: E402
from model.serve.engine.kv_cache import FULL, SWA, KVLayout, PagedKVCache  # noqa: E402
from model.serve.paged_attention import PagedAttention  # noqa: E402
from model.serve.runner import ModelRunner  # noqa: E402

BEAM = {"hq": 6, "hkv": 1, "d": 128, "window": 512, "page": 16}  # TP8 per-rank attention
# Elementwise bound FlashInfer vs torch: the torch path rounds scores and probabilities to BF16
# (~0.4% each), FlashInfer keeps them in FP32; outputs are O(1), so 2e-2 + 2e-2|ref| leaves >2x
# margin over the reference's own rounding error. Against FP64 attention FlashInfer's error is
# its BF16 output rounding (2^-9) plus BF16 P in the MMA: relative L2 below 1e-2.
ATOL, RTOL, REL_L2_EXACT = 2e-2, 2e-2, 1e-2


# ---- harness (also used by the tests) --------------------------------------------------------
@dataclass
class Chunk:
    """Tokens [start, start + num_tokens) of sequence seq_id (the scheduler's chunk shape)."""

    seq_id: int
    start: int
    num_tokens: int
    token_ids: list[int] = field(default_factory=list)
    sample: bool = True


def make_case(steps: list[tuple[int, int]], *, hq: int, hkv: int, d: int, window: int,
              page: int, dtype: torch.dtype, device: str, seed: int = 0):
    """A cache with layer 0 full and layer 1 windowed, sequence i holding steps[i][0] tokens and
    allocated for steps[i][1] more; every slot random. -> (cache, chunks, generator)."""
    layout = KVLayout((0,), (1,), window, page, hkv, d, dtype)
    full = sum(math.ceil((s + n) / page) for s, n in steps) + 1
    # Contexts are allocated one sequence at a time and trimmed at once: the largest one plus
    # this step's tokens is the most in flight.
    most = max(s for s, _ in steps) + sum(n for _, n in steps)
    swa = layout.swa_reserve(len(steps), most, max(s + n for s, n in steps))
    cache = PagedKVCache(layout, full, swa, device)
    for i, (s, _) in enumerate(steps):
        if s:
            cache.allocate(i, s)
            cache.trim(i)  # as between steps: window pages behind the window go back
    for i, (_, n) in enumerate(steps):
        cache.allocate(i, n)
    gen = torch.Generator(device=device).manual_seed(seed)
    for t in (*cache.k.values(), *cache.v.values()):
        t.copy_(torch.randn(t.shape, generator=gen, device=device, dtype=torch.float32))
    return cache, [Chunk(i, s, n, [0] * n) for i, (s, n) in enumerate(steps)], gen


def prepare(cache: PagedKVCache, chunks: list[Chunk], backend):
    """The runner's own batch layout (decodes first) and plan hook, without a model."""
    runner = ModelRunner.__new__(ModelRunner)
    runner.cache, runner.device, runner.batched_decode = cache, cache.device, True
    runner.model = SimpleNamespace(attention_backend=backend)
    ordered = [chunks[i] for i in runner.order(chunks)]
    return ordered, runner.prepare(ordered)[2]


def exact_attention(cache: PagedKVCache, group: str, ordered: list[Chunk], q: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """FP64 causal (windowed) attention of every chunk over its cached keys -> [T, Hq, D]."""
    window, outs = (cache.layout.window if group == SWA else 0), []
    _, k_pages, v_pages = cache.layer_cache(0 if group == FULL else 1)
    flat_k, flat_v = k_pages.flatten(0, 1), v_pages.flatten(0, 1)
    row = 0
    for c in ordered:
        stop = c.start + c.num_tokens
        lo = max(0, c.start - window + 1) if window else 0
        slots = torch.tensor(cache.slots(c.seq_id, group, lo, stop), device=q.device)
        k, v = flat_k[slots].double(), flat_v[slots].double()  # [S, Hkv, D]
        qc = q[row:row + c.num_tokens].double()
        rep = qc.shape[1] // k.shape[1]
        s = torch.einsum("thd,shd->hts", qc, k.repeat_interleave(rep, 1)) * scale
        q_pos = torch.arange(c.start, stop, device=q.device)
        dist = q_pos[:, None] - torch.arange(lo, stop, device=q.device)[None, :]
        ok = dist >= 0
        if window:
            ok &= dist < window
        p = torch.softmax(s.masked_fill(~ok, -math.inf), -1)
        outs.append(torch.einsum("hts,shd->thd", p, v.repeat_interleave(rep, 1)))
        row += c.num_tokens
    return torch.cat(outs)


def run_both(cache: PagedKVCache, chunks: list[Chunk], fi_backend, gen, hq: int):
    """(ordered chunks, {group: (flashinfer out, torch out, fp64 out)}) for one random step."""
    lay = cache.layout
    torch_backend = PagedAttention(cache, lambda: SimpleNamespace(attention=attention_ref))
    ordered, batch = prepare(cache, chunks, fi_backend)
    t, scale, dev = batch.positions.numel(), lay.head_dim**-0.5, cache.device
    out = {}
    for layer, group in ((0, FULL), (1, SWA)):
        window = lay.window if group == SWA else 0
        q, k, v = (torch.randn(t, h, lay.head_dim, generator=gen, device=dev).to(lay.dtype)
                   for h in (hq, lay.num_kv_heads, lay.num_kv_heads))
        fi = fi_backend(layer, q, k, v, window, scale, batch)
        ref = torch_backend(layer, q, k, v, window, scale, batch)  # writes the same K/V again
        out[group] = (fi, ref, exact_attention(cache, group, ordered, q, scale))
    return ordered, out


def compare(fi: torch.Tensor, ref: torch.Tensor, exact: torch.Tensor) -> dict:
    fi, ref, exact = fi.double(), ref.double(), exact.double()
    bound = ATOL + RTOL * ref.abs()
    return {"max_abs_diff": float((fi - ref).abs().max()),
            "frac_beyond_bound": float(((fi - ref).abs() > bound).double().mean()),
            "rel_l2_flashinfer_vs_fp64": float((fi - exact).norm() / exact.norm()),
            "rel_l2_torch_vs_fp64": float((ref - exact).norm() / exact.norm())}


# ---- the GPU run -----------------------------------------------------------------------------
CASES = {  # name: (start, new tokens) per sequence
    "decode 1/17/600/1500 x2 (odd batch 7)": [(0, 1), (16, 1), (599, 1), (1499, 1),
                                              (1023, 1), (511, 1), (4095, 1)],
    "prefill chunks 17@0, 300@1000, 512@3000": [(0, 17), (1000, 300), (3000, 512)],
    "mixed: 3 decodes + 2 chunks": [(9, 1), (2047, 1), (700, 1), (0, 33), (520, 100)],
}


def jit(fi_cls, say) -> float:
    """Build the kernels (first plan + run) on a small case; seconds."""
    t0 = time.perf_counter()
    cache, chunks, gen = make_case([(40, 1), (0, 20)], **BEAM, dtype=torch.bfloat16,
                                   device="cuda")
    backend = fi_cls(cache, num_qo_heads=BEAM["hq"], max_model_len=8192)
    say("JIT-compiling FlashInfer batch prefill/decode (fa2, bf16, head_dim 128) ...")
    run_both(cache, chunks, backend, gen, BEAM["hq"])
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def median_ms(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def time_decode(fi_cls, ctx: int, batch: int, iters: int) -> dict:
    cache, chunks, gen = make_case([(ctx - 1, 1)] * batch, **BEAM, dtype=torch.bfloat16,
                                   device="cuda")
    fi = fi_cls(cache, num_qo_heads=BEAM["hq"], max_model_len=ctx + 16)
    tb = PagedAttention(cache, lambda: SimpleNamespace(attention=attention_ref))
    t0 = time.perf_counter()
    _, b = prepare(cache, chunks, fi)
    plan_ms = (time.perf_counter() - t0) * 1e3
    q = torch.randn(batch, BEAM["hq"], BEAM["d"], generator=gen, device="cuda").bfloat16()
    kv = torch.randn(batch, BEAM["hkv"], BEAM["d"], generator=gen, device="cuda").bfloat16()
    row = {"context": ctx, "batch": batch, "prepare_and_plan_ms": plan_ms}
    for layer, w, name in ((0, 0, "full"), (1, BEAM["window"], "window")):
        for label, backend in (("torch", tb), ("flashinfer", fi)):
            call = functools.partial(backend, layer, q, kv, kv, w, BEAM["d"]**-0.5, b)
            call()
            row[f"{name}_{label}_ms"] = median_ms(call, iters)
        row[f"{name}_speedup"] = row[f"{name}_torch_ms"] / row[f"{name}_flashinfer_ms"]
    del cache, fi, tb
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, default=270.0, help="stop timing past this")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    start = time.perf_counter()
    say = lambda m: print(f"[{time.perf_counter() - start:6.1f}s] {m}", flush=True)  # noqa: E731
    from model.serve.flashinfer_attention import FlashInferAttention, available

    ok, why = available(BEAM["d"], torch.bfloat16)
    report: dict = {"available": ok, "why": why, "device": torch.cuda.get_device_name()
                    if torch.cuda.is_available() else None, "shapes": BEAM,
                    "tolerance": {"atol": ATOL, "rtol": RTOL, "rel_l2_fp64": REL_L2_EXACT}}
    args.out.mkdir(parents=True, exist_ok=True)
    if not ok:
        say(f"FlashInfer unavailable: {why}")
        write(args.out, report)
        sys.exit(1)
    report["jit_s"] = jit(FlashInferAttention, say)
    say(f"JIT + first run: {report['jit_s']:.1f}s ({why})")
    report["agreement"], failures = [], 0
    for name, steps in CASES.items():
        cache, chunks, gen = make_case(steps, **BEAM, dtype=torch.bfloat16, device="cuda", seed=3)
        fi = FlashInferAttention(cache, num_qo_heads=BEAM["hq"], max_model_len=8192)
        for group, (a, r, e) in run_both(cache, chunks, fi, gen, BEAM["hq"])[1].items():
            row = {"case": name, "pool": group, **compare(a, r, e)}
            row["ok"] = (row["frac_beyond_bound"] == 0
                         and row["rel_l2_flashinfer_vs_fp64"] < REL_L2_EXACT)
            failures += not row["ok"]
            report["agreement"].append(row)
            say(f"{name} [{group}]: max|fi-torch| {row['max_abs_diff']:.2e}, rel L2 vs fp64 "
                f"fi {row['rel_l2_flashinfer_vs_fp64']:.1e} torch "
                f"{row['rel_l2_torch_vs_fp64']:.1e} {'ok' if row['ok'] else 'FAIL'}")
    report["timing"], report["timing_skipped"] = [], []
    for ctx in (1024, 4096, 16384, 32768):
        for batch in (1, 8, 64):
            if time.perf_counter() - start > args.budget_s:
                report["timing_skipped"].append([ctx, batch])
                continue
            row = time_decode(FlashInferAttention, ctx, batch, args.iters)
            report["timing"].append(row)
            say(f"decode ctx {ctx} batch {batch}: full torch {row['full_torch_ms']:.3f} ms, "
                f"flashinfer {row['full_flashinfer_ms']:.3f} ms; window torch "
                f"{row['window_torch_ms']:.3f}, flashinfer {row['window_flashinfer_ms']:.3f}")
    report["total_s"] = time.perf_counter() - start
    write(args.out, report)
    say(f"wrote {args.out}/flashinfer_check.json and .md; {failures} agreement failures")
    sys.exit(1 if failures else 0)


def write(out: Path, report: dict) -> None:
    (out / "flashinfer_check.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = ["# FlashInfer attention check", "",
             f"- available: {report['available']} ({report['why']}); device {report['device']}",
             f"- JIT + first run: {report.get('jit_s', float('nan')):.1f} s", "",
             "| case | pool | max abs fi-torch | rel L2 fi-fp64 | rel L2 torch-fp64 | ok |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['pool']} | {r['max_abs_diff']:.2e} | "
              f"{r['rel_l2_flashinfer_vs_fp64']:.1e} | {r['rel_l2_torch_vs_fp64']:.1e} | "
              f"{r['ok']} |" for r in report.get("agreement", [])]
    lines += ["", "Decode attention per layer (K/V write + attention), median ms:", "",
              "| context | batch | full torch | full fi | x | window torch | window fi | x |",
              "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['context']} | {r['batch']} | {r['full_torch_ms']:.3f} | "
              f"{r['full_flashinfer_ms']:.3f} | {r['full_speedup']:.1f} | "
              f"{r['window_torch_ms']:.3f} | {r['window_flashinfer_ms']:.3f} | "
              f"{r['window_speedup']:.1f} |" for r in report.get("timing", [])]
    if report.get("timing_skipped"):
        lines.append(f"\nSkipped (budget): {report['timing_skipped']}")
    (out / "flashinfer_check.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
