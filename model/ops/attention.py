"""attention(q[T,Hq,D], k_cache[P,page,Hkv,D], v_cache[P,page,Hkv,D], page_table[B,R],
kv_base[B], q_seq[T], q_pos[T], window, scale) -> [T,Hq,D]

Causal GQA attention over a paged KV cache, the form the server runs: decode rows and prefill
chunks of any number of sequences in one call. Query token t belongs to page-table row
b = q_seq[t] and sits at position p = q_pos[t]; it sees the keys of its row at positions j with
kv_base[b] <= j <= p and, on sliding-window layers (window > 0), p - j < window (window keys
including itself). Key j of row b is in slot page_table[b, (j - kv_base[b]) // page] * page +
(j - kv_base[b]) % page of k_cache/v_cache (model/ops/_paged.py). The caller's keys at every
visible position are written (by `qk_norm_rope` / `qk_norm_ssmax`, before this op); slots past
a query's position or before its window may hold anything, including other sequences' stale
keys, and must not change its output. Full-attention (SSMax) layers are plain causal: their q
arrives already scaled by tau, and `scale` is 1/sqrt(head_dim) on every layer.

The reference is transformers' *eager* path, pinned for golden outputs (docs/numerics.md
"Attention"), with its rounding points: scores bf(q.k) (FP32 accumulation), scaled in BF16
(bf(f32(s) * scale)), masked, FP32 softmax rounded to BF16, BF16 P.V with FP32 accumulation,
one rounding. Two forms of it, the same math up to GEMM reduction order:
- one page-table row per query token (B == T, decode): every row's pages gathered and masked,
  static shapes and no host sync, so CUDA graphs can capture it;
- otherwise (prefill chunks, mixed steps) per sequence over exactly the keys its queries can
  see, the shapes transformers uses (the no-cache forward is bitwise transformers' there).
"""

from __future__ import annotations

import torch

from ._contract import Cost, Numerics, Shape, gen, randn
from ._paged import DEFAULT_PAGE

NAME = "attention"
SIGNATURE = (
    "attention(q[T,Hq,D] bf16, k_cache[P,page,Hkv,D] bf16, v_cache[P,page,Hkv,D] bf16, "
    "page_table[B,R] int64, kv_base[B] int64, q_seq[T] int64, q_pos[T] int64, "
    "window: int (0 = full), scale: float) -> [T,Hq,D] bf16"
)
AXES = {
    "T": "query tokens",
    "B": "sequences, one page-table row each (varies)",
    "seqs": "sequences of a shape, 0 = one per query (a test-shape knob; B = T when 0)",
    "R": "page-table width in pages (varies)",
    "P": "pages in the layer's cache (varies)",
    "S": "context: keys before and including a sequence's last query",
    "Hq": "query heads/rank",
    "Hkv": "KV heads/rank",
    "W": "sliding window (0 = full attention)",
    "page": "KV cache page size",
}

# Test shapes (model/ops/_contract.py "Test shapes"): see `test_shapes` below.
CPU_DIMS = {"Hq": 6, "Hkv": 1, "D": 128}
FREE_DIMS = {"Hq": (1, 12)}
TOKEN_RANGE = {"cpu": (1, 64)}
EDGE_SCALES = {"tiny": {0: 2.0**-40}, "huge": {0: 2.0**4}}
GPU_MIN_CONTEXT = 4096
# A full (NoPE) layer at long contexts, drawn per run: decode rows anywhere from the buckets'
# context (GPU_MIN_CONTEXT) up and near the top, which on a GPU is past every target's longest
# (above 100k) and on the CPU as far as the interpreter affords (past 16k keys, where a split-KV
# kernel's splits stop multiplying and its chunks grow); and prefill chunks of two sequences
# deep in a long context (chunked prefill). Without them, a kernel that drops, truncates or
# mis-splits keys past some count would never meet such a count.
LONG_CONTEXT = {"cpu": (1024, 20000), "gpu": (GPU_MIN_CONTEXT + 1, 131072)}
EDGE_SHAPES = {
    "long_context": {"S": LONG_CONTEXT, "W": 0, "seqs": 0},
    "longest_context": {"S": {k: (hi * 4 // 5, hi) for k, (_, hi) in LONG_CONTEXT.items()},
                        "W": 0, "seqs": 0},
    "long_context_chunks": {"S": LONG_CONTEXT, "W": 0, "seqs": 2},
}


def check(q, k_cache, v_cache, page_table, kv_base, q_seq, q_pos) -> None:
    """The shapes the contract takes; a clear error otherwise."""
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"attention expects q[T,Hq,D] and k/v_cache[P,page,Hkv,D]; got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    if k_cache.shape[3] != d or hq % hkv:
        raise ValueError(f"head_dim {d} / query heads {hq} do not fit the cache's "
                         f"[.., Hkv={hkv}, D={k_cache.shape[3]}] (Hq must be a multiple of Hkv)")
    b = page_table.shape[0] if page_table.dim() == 2 else -1
    if b < 1 or kv_base.shape != (b,) or q_seq.shape != (t,) or q_pos.shape != (t,):
        raise ValueError(f"page_table must be [B, R] with kv_base [B], q_seq and q_pos [T={t}]; "
                         f"got {tuple(page_table.shape)}, {tuple(kv_base.shape)}, "
                         f"{tuple(q_seq.shape)}, {tuple(q_pos.shape)}")


def _scores(qh, k, scale, round_scores: bool = True):
    if round_scores:
        return torch.matmul(qh, k) * scale  # BF16 product, BF16 scale: two roundings
    return torch.matmul(qh.float(), k.float()) * scale


def _scores_probs(qh, k, mask, scale, dtype, round_scores: bool = True,
                  round_probs: bool = True):
    """Softmax probabilities of qh against k with an additive mask, at the eager rounding points
    (a near miss drops one of them)."""
    probs = torch.softmax(_scores(qh, k, scale, round_scores) + mask, dim=-1, dtype=torch.float32)
    return probs.to(dtype) if round_probs else probs


FLIP_ROWS = 256  # query rows per block of `magnitude`'s pass
# ulps of bf16 at a magnitude m are at least m * 2^-8: at FLIP_SCALE * bound, max_ulp (3)
# of them cover a change of `bound`.
FLIP_SCALE = 2.0**8 / 3


def _error_scale(qh, k, mask, scale, dtype, v):
    """`magnitude` from one pass over the scores: the larger of the P.V terms' size,
    bf(P) @ |v| as the reference computes it, and FLIP_SCALE times the largest change one
    flipped score or probability can make, max_j w_j * max_j |v_j| over the keys a row sees
    (masked keys weigh 0)."""
    scores = _scores(qh, k, scale)
    probs = torch.softmax(scores + mask, dim=-1, dtype=torch.float32)
    terms = torch.matmul(probs.to(dtype), v.abs()).to(dtype).float()
    # Key j's score rounding the other way (q.k summed in another order, then two roundings)
    # moves it by up to u_j = two of its ulps, and the output by p_j u_j (v_j - out) to first
    # order, where |v_j - out| <= 2 (1 - p_j) max|v|; its rounded probability moving by one of
    # its ulps moves the output by at most p_j 2^-7 max|v|. The weight of key j per max|v|:
    _, e = torch.frexp(scores.float())
    u = torch.ldexp(torch.full_like(probs, 2.0), e - 8)
    w = probs * (2.0 * (1.0 - probs) * u + 2.0**-7)
    flip = w.amax(-1, keepdim=True) * v.float().abs().amax(-2, keepdim=True)
    return torch.maximum(terms, flip * FLIP_SCALE)


def eager_attention(q, k, v, q_pos, k_pos, window: int, scale: float, *,
                    round_scores: bool = True, round_probs: bool = True,
                    error_scale: bool = False, block: int = 0) -> torch.Tensor:
    """One sequence's queries q[T,Hq,D] against its keys k/v[S,Hkv,D] at positions k_pos:
    transformers' eager attention (repeated KV heads, [1, Hq, T, S] scores). `error_scale`:
    FP32 `_error_scale` of each output instead. `block`: that many query rows at a time (the
    same math; the GEMMs' shapes, so their reduction order, may differ), for an error scale
    whose [Hq, T, S] pass would otherwise sit beside the reference's in memory."""
    if block and q.shape[0] > block:
        return torch.cat([eager_attention(q[i:i + block], k, v, q_pos[i:i + block], k_pos,
                                          window, scale, round_scores=round_scores,
                                          round_probs=round_probs, error_scale=error_scale)
                          for i in range(0, q.shape[0], block)])
    n_rep = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D]
    kh = k.transpose(0, 1).repeat_interleave(n_rep, dim=0).unsqueeze(0)  # [1, Hq, S, D]
    vh = v.transpose(0, 1).repeat_interleave(n_rep, dim=0).unsqueeze(0)
    mask = torch.zeros(q.shape[0], k.shape[0], dtype=q.dtype, device=q.device)
    mask.masked_fill_(~visible(q_pos, k_pos, window), torch.finfo(q.dtype).min)
    if error_scale:
        return _error_scale(qh, kh.transpose(2, 3), mask, scale, q.dtype, vh)[0].transpose(
            0, 1).contiguous()
    probs = _scores_probs(qh, kh.transpose(2, 3), mask, scale, q.dtype, round_scores,
                          round_probs)
    out = torch.matmul(probs, vh if round_probs else vh.float())
    return out.to(q.dtype)[0].transpose(0, 1).contiguous()


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[T, S] bool: which keys (positions k_pos [S], or [T, S] per query) each query may attend."""
    dist = q_pos[:, None] - (k_pos[None, :] if k_pos.dim() == 1 else k_pos)
    ok = dist >= 0
    if window:
        ok &= dist < window
    return ok


def _rows(q, k_cache, v_cache, page_table, kv_base, q_seq, q_pos, window, scale, **flags):
    # One page-table row per query: gather each query's row, mask what it may not see.
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    table = page_table[q_seq]  # [T, R]
    k = k_cache[table].reshape(t, -1, hkv, d)  # [T, S, Hkv, D]
    v = v_cache[table].reshape(t, -1, hkv, d)
    k_pos = kv_base[q_seq][:, None] + torch.arange(k.shape[1], device=q.device)[None, :]
    ok = visible(q_pos, k_pos, window)  # [T, S]
    # Slots a query may not see hold anything (stale or unwritten keys): they must not reach
    # the sums, where 0 * NaN would still be NaN.
    zero = torch.zeros((), dtype=k.dtype, device=k.device)
    k = torch.where(ok[:, :, None, None], k, zero)
    v = torch.where(ok[:, :, None, None], v, zero)
    mask = torch.zeros(ok.shape, dtype=q.dtype, device=q.device)
    mask.masked_fill_(~ok, torch.finfo(q.dtype).min)
    qh = q.view(t, hkv, hq // hkv, d)  # query head h reads KV head h // (Hq / Hkv)
    flags.pop("block", None)  # one query row per page-table row: nothing to split
    kt, mask, vv = k.permute(0, 2, 3, 1), mask[:, None, None, :], v.permute(0, 2, 1, 3)
    if flags.pop("error_scale", False):
        return _error_scale(qh, kt, mask, scale, q.dtype, vv).reshape(t, hq, d)
    probs = _scores_probs(qh, kt, mask, scale, q.dtype, **flags)  # [T, Hkv, rep, S]
    out = torch.matmul(probs, vv if probs.dtype == vv.dtype else vv.float())
    return out.to(q.dtype).reshape(t, hq, d)


def _per_sequence(q, k_cache, v_cache, page_table, kv_base, q_seq, q_pos, window, scale,
                  **flags):
    # Consecutive tokens of one row are one sequence's chunk: its keys gathered once, exactly
    # the positions its queries can see (host-side index math; not for CUDA graphs).
    page, hkv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    seqs, pos, bases = q_seq.tolist(), q_pos.tolist(), kv_base.tolist()
    outs, start = [], 0
    while start < len(seqs):
        stop = start
        while stop < len(seqs) and seqs[stop] == seqs[start]:
            stop += 1
        row = seqs[start]
        lo, hi = bases[row], max(pos[start:stop]) + 1
        if window:
            lo = max(lo, min(pos[start:stop]) - window + 1)
        j = torch.arange(lo, hi, device=q.device) - bases[row]
        slots = page_table[row][j // page] * page + j % page
        outs.append(eager_attention(q[start:stop], flat_k[slots], flat_v[slots],
                                    q_pos[start:stop], j + bases[row], window, scale, **flags))
        start = stop
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def _attention(q, k_cache, v_cache, page_table, kv_base, q_seq, q_pos, window, scale, **flags):
    check(q, k_cache, v_cache, page_table, kv_base, q_seq, q_pos)
    if q.shape[0] == 0:
        return torch.empty_like(q)
    form = _rows if page_table.shape[0] == q.shape[0] else _per_sequence
    return form(q, k_cache, v_cache, page_table, kv_base, q_seq, q_pos, window, scale, **flags)


def reference(q, k_cache, v_cache, page_table, kv_base, q_seq, q_pos, window: int,
              scale: float) -> torch.Tensor:
    return _attention(q, k_cache, v_cache, page_table, kv_base, q_seq, q_pos, window, scale)


def _fp32_probs(*args):
    # Near miss: probabilities stay FP32 into P.V (what flash kernels and FlashInfer do).
    return _attention(*args, round_probs=False)


def _fp32_scores(*args):
    # Near miss: q.k and its scaling stay FP32 (no BF16 score roundings).
    return _attention(*args, round_scores=False)


def magnitude(q, k_cache, v_cache, page_table, kv_base, q_seq, q_pos, window: int,
              scale: float) -> torch.Tensor:
    """[T, Hq, D] FP32: the larger of
    - sum_j P_j |v_j|, the size of the terms P.V adds (values cancel there, so a near-zero
      output moves by many of its own ulps when one term's rounding flips), and
    - FLIP_SCALE times the change one flipped BF16 score or probability can make to the output
      (`_error_scale`, one pass over the scores for both): where one key dominates a row
      (outlier channels in q make such rows), a score that rounds the other way moves its
      weight by up to 2^-6 and the output by many ulps of sum_j P_j |v_j|. On Gaussian
      inputs the first term is the larger for 98-99% of outputs over 4096 keys and ~91% over
      a 512-key window; over a few dozen keys rows are peaky by themselves and most widen
      (tests/test_numerics_scales.py)."""
    if q.shape[0] == 0:
        return torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    return _attention(q, k_cache, v_cache, page_table, kv_base, q_seq, q_pos, window, scale,
                      error_scale=True, block=FLIP_ROWS)


NUMERICS = Numerics(
    kind="ulp",
    max_ulp=3,
    # One BF16 score that rounds the other way (q.k in another order) moves its probability by
    # an ulp and so all D outputs of that head a little: at T = 1 a single flip is 1/Hq of the
    # outputs. The near misses (~40-60% of outputs) are what tell the rounding points apart.
    # Over thousands of keys a few such flips can add up in one output: on an H200 the Triton
    # variant had 1 output in 24M at 3 ulp and 47 at 2 (prefill of 7897 tokens over two
    # sequences, Hq=24), everything else at most 1 ulp. Where one key dominates a row (outlier
    # channels in q), one flip of its score moves the output by up to ~10 ulps of the terms (28
    # outputs in 6.1M, max 9, at T=1979): `magnitude`'s flip term counts those at its scale.
    max_mismatch_fraction=0.1,
    near_misses={"fp32_probs": _fp32_probs, "fp32_scores": _fp32_scores},
    magnitude=magnitude,
    note=("Rounding points a kernel must keep (kernels/attention/triton_v1.py keeps all of "
          "them): (1) scores bf(q.k) with FP32 accumulation; (2) the scale applied to the BF16 "
          "score in FP32 and rounded, bf(f32(s) * scale); (3) masked keys contribute exactly "
          "nothing (the additive finfo.min mask; a kernel may skip them); (4) FP32 softmax over "
          "the BF16 scaled scores (exact max, expf, IEEE divide) rounded to BF16; (5) P.V with "
          "BF16 operands, FP32 accumulation and one rounding. Only reduction orders may differ "
          "(q.k over D, the softmax sum, P.V over the keys): a flipped BF16 score or "
          "probability moves an output by an ulp or two of the terms P.V adds (ulps are counted "
          "at `magnitude`: values cancel, and one flip of a dominant key's score moves its row "
          "by its weight), so at most 3 such ulp on at most 10% of outputs (near-bitwise under "
          "the CPU interpreter; the GPU bound is measured by benchmarks/attention_gpu.py). A "
          "kernel that keeps FP32 scores or probabilities "
          "(flash numerics, FlashInfer) changes ~40% of outputs and is closer to a near miss: "
          "the tuned set stays at transformers' eager rounding points."),
)


def sequences(shape: Shape) -> int:
    """B of a shape: B where a call's page table gave it, else `seqs` sequences (at most T), or
    one per query token when 0 or absent."""
    t, seqs = shape["T"], int(shape.get("B", 0) or shape.get("seqs", 0) or 0)
    return max(1, min(seqs, t)) if seqs else t


def _layout(shape: Shape) -> tuple[list[int], list[int]]:
    """(tokens per sequence, context of each sequence): decode rows when B == T, else chunks
    (each sequence's context at least its chunk)."""
    t, b = shape["T"], sequences(shape)
    if t == 0:  # zero rows: a page table and a cache exist, no query reads them
        return [0], [shape["S"]]
    s = max(shape["S"], -(-t // b))
    if b == t:
        counts = [1] * t
    else:  # t tokens over b chunks, the first chunks one token longer
        counts = [t // b + (i < t % b) for i in range(b)]
    # Contexts vary per sequence (the longest is S) but not with the seed: the positions and
    # page-table widths are the shape's, so any seed's tensors fit any other seed's.
    lo = max(max(counts), s // 2)
    ctx = [s - (i * 37) % (s - lo + 1) for i in range(b)]
    return counts, ctx


def make_inputs(shape: Shape, seed: int, device="cpu", dtype=torch.bfloat16) -> tuple:
    g = gen(seed)
    t, hq, hkv, d = shape["T"], shape["Hq"], shape["Hkv"], shape["D"]
    window, page = int(shape.get("W", 0)), int(shape.get("page", DEFAULT_PAGE))
    counts, ctx = _layout(shape)
    # The window pool holds pages from the one with the chunk's first visible key (as the
    # runtime's cache does); full layers from position 0.
    bases = [max(0, c - n - window + 1) // page * page if window else 0
             for c, n in zip(ctx, counts)]
    need = [-(-(c - base) // page) for c, base in zip(ctx, bases)]
    width = max(need) + 1  # one unused column: rows are padded, as the runtime pads them
    # Distinct pages per row; rows share a pool capped at 4096 pages (as sequences may share
    # pages), page 0 included, so a large batch stays small.
    pool = min(width * len(need) + 1, max(4096, width + 1))
    pool += pool == t  # never T pages: the verifier may hand token-major tensors as views
    table = torch.stack([torch.randperm(pool, generator=g)[:width] for _ in need])
    q = randn((t, hq, d), g, dtype, device)
    k_cache = randn((pool, page, hkv, d), g, dtype, device)
    v_cache = randn((pool, page, hkv, d), g, dtype, device)
    q_seq = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    q_pos = torch.cat([torch.arange(c - n, c) for c, n in zip(ctx, counts)])
    as_long = dict(dtype=torch.long, device=device)
    return (q, k_cache, v_cache, table.to(**as_long), torch.tensor(bases, **as_long),
            q_seq.to(**as_long), q_pos.to(**as_long), window, d**-0.5)


def cost(shape: Shape) -> Cost:
    t, s, hq, hkv, d = shape["T"], shape["S"], shape["Hq"], shape["Hkv"], shape["D"]
    b = sequences(shape)
    keys = min(s, shape.get("W", 0) or s)
    # q in, out back; every sequence's visible K and V once; the int64 indexing.
    byts = 2 * (2 * t * hq * d + 2 * b * keys * hkv * d) + 8 * (2 * t + b * keys // 16 + b)
    return Cost(bytes=byts, flops=4 * t * keys * hq * d)


def shapes_for(cfg, tokens: int, shard=None, context: int | None = None, layer: int = 0,
               seqs: int | None = None, page_size: int = DEFAULT_PAGE) -> dict[str, int]:
    """`tokens` queries over `seqs` sequences (default: one query per sequence, decode) whose
    longest context is `context` keys (default: `tokens`)."""
    hq = shard.num_attention_heads if shard else cfg.num_attention_heads
    hkv = shard.num_key_value_heads if shard else cfg.num_key_value_heads
    return {
        "T": tokens,
        "seqs": seqs or 0,
        "S": context or tokens,
        "Hq": hq,
        "Hkv": hkv,
        "D": cfg.head_dim,
        "W": cfg.window(layer) or 0,
        "page": page_size,
    }


def test_shapes(cfg, shard, tokens: int, kind: str) -> list[dict[str, int]]:
    """Decode rows (one query per sequence) on full and sliding-window layers, and prefill
    chunks of a few sequences, over contexts longer than the queries."""
    if kind == "cpu":
        return ([{"T": tokens, "seqs": 0, "S": tokens + 37, "W": w, "page": 4, **CPU_DIMS}
                 for w in (0, 16)]
                + [{"T": tokens, "seqs": 2, "S": tokens + 37, "W": 16, "page": 4, **CPU_DIMS}])
    layers = range(cfg.num_hidden_layers)
    full = next((i for i in layers if cfg.window(i) is None), 0)
    slide = next((i for i in layers if cfg.window(i) is not None), None)
    ctx = max(GPU_MIN_CONTEXT, tokens)
    out = [shapes_for(cfg, tokens, shard, context=ctx, layer=full)]
    if slide is not None:
        out.append(shapes_for(cfg, tokens, shard, context=ctx, layer=slide))
    out.append(shapes_for(cfg, tokens, shard, context=ctx, layer=full, seqs=2))
    return out
