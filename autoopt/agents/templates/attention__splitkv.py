"""attention: split-KV flash decoding over the paged KV cache at the eager rounding points.

# {{HEADER}}

Contract (model/ops/attention.py): query t of page-table row b = q_seq[t] at position p =
q_pos[t] sees the keys j of row b with lo <= j <= p, lo = kv_base[b], or max(kv_base[b],
p - window + 1) on sliding-window layers; key j sits in slot page_table[b, (j - kv_base[b]) //
PAGE] * PAGE + (j - kv_base[b]) % PAGE. GQA: query head g*G..g*G+G-1 read KV head g (G = Hq/Hkv,
6 at Beam's TP8 rank); the G heads of one KV head share one program, so K and V are read once
per KV head.

Decode (one page-table row per query, B == T): two launches over a grid (T, Hkv, SPLITS), the
visible keys cut into SPLITS contiguous chunks of BLOCK_N-key blocks:
  1. scores: s = bf(q . k) (FP32 accumulation), s' = bf(f32(s) * scale), stored BF16 to a
     workspace; per split the running max m_i and sum l_i = sum exp(s' - m_i) (online).
  2. P.V: m = max_i m_i, l = sum_i l_i * exp(m_i - m) (a fixed tree over the splits);
     P = bf(exp(s' - m) / l) (IEEE divide); the split's partial o_i = sum P . v in FP32; the
     last program of each (token, KV head) to finish (an atomic ticket) sums the partials, a
     fixed order (chunks of COMBINE splits, in order), and rounds once: out = bf(sum_i o_i).
Rounding points kept, as the eager reference: BF16 scores, BF16 scaled scores, masking by
exclusion (the reference's additive finfo.min mask underflows exp to exactly 0), FP32 softmax
(exact max, expf, IEEE divide) rounded to BF16, BF16 P.V operands with FP32 accumulation and one
rounding. What differs is reduction order only: q.k over D (tensor-core order), the softmax sum
(online per split, then rescaled per split) and P.V over the keys (per split, then summed).
Keys a query may not see are never read, so stale or unwritten slots cannot reach the output.
Prefill and mixed steps (B < T) run the reference's own per-sequence eager math in torch (the
same rounding points); this variant targets decode.
Memory traffic (decode): per (token, KV head) the visible K and V once (2 * n * D bf16), q and the
output, the page-table entries, plus the BF16 score workspace written and read (2 * G * n bf16,
~5% of K/V at G = 6) and the FP32 split partials (SPLITS * G * D).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

CONFIG_SPACE = {"SPLITS": [0, 1, 2, 4, 8, 16, 32, 64, 128], "BLOCK_N": [16, 32, 64, 128],
                "num_warps": [2, 4, 8]}
# SPLITS 0: about two programs per SM (from T * Hkv), a power of two, at most 64: the split
# partials are summed by one program, so more splits cost more at the end.
DEFAULT_CONFIG = {"SPLITS": 0, "BLOCK_N": 64, "num_warps": 4}
ARCHS = None  # any: Triton on CUDA GPUs, the interpreter on the CPU
_TICKETS: dict[tuple[str, int], torch.Tensor] = {}


# {{common.bf16_to_f32}}: _bf16_to_f32


# {{common.f32_to_bf16}}: _f32_to_bf16


# {{common.exp}}: _exp


# {{common.dot}}: _dot


@triton.jit
def _key_range(q_seq_ptr, q_pos_ptr, base_ptr, t, split, WINDOW: tl.constexpr,
               SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
    # (row, first visible key, this split's [start, end), the row's kv_base)
    row = tl.load(q_seq_ptr + t)
    p = tl.load(q_pos_ptr + t)
    base = tl.load(base_ptr + row)
    lo = base
    if WINDOW > 0:
        lo = tl.maximum(base, p - WINDOW + 1)
    n = p + 1 - lo
    chunk = tl.cdiv(tl.cdiv(n, SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, p + 1)
    return row, lo, start, end, base


@triton.jit
def _slots(table_ptr, row, base, j, valid, W, PAGE: tl.constexpr):
    rel = j - base
    page = tl.load(table_ptr + row * W + rel // PAGE, mask=valid, other=0)
    return page * PAGE + rel % PAGE


@triton.jit
def _attention_scores_kernel(q_ptr, k_ptr, table_ptr, base_ptr, q_seq_ptr, q_pos_ptr, s_ptr,
                             m_ptr, l_ptr, scale, W, SMAX, HQ, HKV, G, q_st,
                             WINDOW: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr,
                             BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                             SPLITS: tl.constexpr, ON_GPU: tl.constexpr):
    t, h, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row, lo, start, end, base = _key_range(q_seq_ptr, q_pos_ptr, base_ptr, t, split, WINDOW,
                                           SPLITS, BLOCK_N)
    g = tl.arange(0, BLOCK_G)
    gmask = g < G
    d = tl.arange(0, D)
    heads = (h * G + g).to(tl.int64)
    q = tl.load(q_ptr + t.to(tl.int64) * q_st + heads[:, None] * D + d[None, :],
                mask=gmask[:, None], other=0.0)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    acc_l = tl.zeros([BLOCK_G], tl.float32)
    srow = s_ptr + (t.to(tl.int64) * HQ + heads) * SMAX  # [BLOCK_G] score rows
    for kb in range(start, end, BLOCK_N):
        j = kb + tl.arange(0, BLOCK_N)
        valid = j < end
        slot = _slots(table_ptr, row, base, j, valid, W, PAGE).to(tl.int64)
        k = tl.load(k_ptr + (slot * HKV + h)[:, None] * D + d[None, :], mask=valid[:, None],
                    other=0.0)
        s = _f32_to_bf16(_dot(q, tl.trans(k), ON_GPU))  # bf(q . k), [BLOCK_G, BLOCK_N]
        s = _f32_to_bf16(_bf16_to_f32(s) * scale)  # bf(f32(s) * scale)
        keep = gmask[:, None] & valid[None, :]
        tl.store(srow[:, None] + (j - lo)[None, :], s, mask=keep)
        sf = tl.where(keep, _bf16_to_f32(s), float("-inf"))
        m_new = tl.maximum(m, tl.max(sf, axis=1))
        # Rows with no key yet keep m = -inf: their factors must be 0, not exp(nan).
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.where(m == float("-inf"), 0.0, _exp(m - safe, ON_GPU))
        acc_l = acc_l * alpha + tl.sum(_exp(sf - safe[:, None], ON_GPU), axis=1)
        m = m_new
    stat = (t.to(tl.int64) * HQ + heads) * SPLITS + split
    tl.store(m_ptr + stat, m, mask=gmask)
    tl.store(l_ptr + stat, acc_l, mask=gmask)


@triton.jit
def _attention_pv_kernel(v_ptr, table_ptr, base_ptr, q_seq_ptr, q_pos_ptr, s_ptr, m_ptr, l_ptr,
                         part_ptr, ticket_ptr, out_ptr, W, SMAX, HQ, HKV, G, o_st,
                         WINDOW: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                         COMBINE: tl.constexpr, ON_GPU: tl.constexpr):
    t, h, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row, lo, start, end, base = _key_range(q_seq_ptr, q_pos_ptr, base_ptr, t, split, WINDOW,
                                           SPLITS, BLOCK_N)
    g = tl.arange(0, BLOCK_G)
    gmask = g < G
    d = tl.arange(0, D)
    heads = (h * G + g).to(tl.int64)
    # The global max and sum from every split's (m_i, l_i), in split order.
    sp = tl.arange(0, SPLITS)
    stat = ((t.to(tl.int64) * HQ + heads) * SPLITS)[:, None] + sp[None, :]
    m_i = tl.load(m_ptr + stat, mask=gmask[:, None], other=float("-inf"))
    l_i = tl.load(l_ptr + stat, mask=gmask[:, None], other=0.0)
    m = tl.max(m_i, axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)  # padded head rows only
    scaled = tl.where(m_i == float("-inf"), 0.0, l_i * _exp(m_i - m[:, None], ON_GPU))
    total = tl.where(gmask, tl.sum(scaled, axis=1), 1.0)  # the same tree in every program
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    srow = s_ptr + (t.to(tl.int64) * HQ + heads) * SMAX
    for kb in range(start, end, BLOCK_N):
        j = kb + tl.arange(0, BLOCK_N)
        valid = j < end
        keep = gmask[:, None] & valid[None, :]
        s = _bf16_to_f32(tl.load(srow[:, None] + (j - lo)[None, :], mask=keep, other=0.0))
        p = tl.div_rn(_exp(s - m[:, None], ON_GPU), total[:, None])
        p = tl.where(keep, p, 0.0)
        slot = _slots(table_ptr, row, base, j, valid, W, PAGE).to(tl.int64)
        v = tl.load(v_ptr + (slot * HKV + h)[:, None] * D + d[None, :], mask=valid[:, None],
                    other=0.0)
        acc += _dot(_f32_to_bf16(p), v, ON_GPU)  # P rounded to BF16, FP32 accumulation
    out = out_ptr + t.to(tl.int64) * o_st + heads[:, None] * D + d[None, :]
    if SPLITS == 1:
        tl.store(out, _f32_to_bf16(acc), mask=gmask[:, None])
    else:
        part = part_ptr + (((t.to(tl.int64) * HQ + heads) * SPLITS)[:, None] + split) * D
        tl.store(part + d[None, :], acc, mask=gmask[:, None])
        tl.debug_barrier()  # every thread's partial is stored before the ticket is taken
        ticket = tl.atomic_add(ticket_ptr + t * HKV + h, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLITS - 1:  # the last split of this (token, KV head) combines them
            o = _combine(part_ptr, t, heads, gmask, HQ, D, BLOCK_G, SPLITS, COMBINE)
            tl.store(out, _f32_to_bf16(o), mask=gmask[:, None])
            tl.atomic_xchg(ticket_ptr + t * HKV + h, 0)  # ready for the next call (and replay)


@triton.jit
def _combine(part_ptr, t, heads, gmask, HQ, D: tl.constexpr, BLOCK_G: tl.constexpr,
             SPLITS: tl.constexpr, COMBINE: tl.constexpr):
    # sum_i o_i over the FP32 split partials [.., SPLITS, D] of these heads: COMBINE splits per
    # load (a tree inside, chunks in order), read from L2 (.cg: other programs wrote them).
    c = tl.arange(0, COMBINE)
    d = tl.arange(0, D)
    rows = ((t.to(tl.int64) * HQ + heads) * SPLITS)[None, :, None]  # [1, BLOCK_G, 1]
    mask = gmask[None, :, None] & (c[:, None, None] >= 0)
    o = tl.zeros([BLOCK_G, D], tl.float32)
    for i0 in range(0, SPLITS, COMBINE):
        ptr = part_ptr + (rows + (i0 + c)[:, None, None]) * D + d[None, None, :]
        o += tl.sum(tl.load(ptr, mask=mask, other=0.0, cache_modifier=".cg"), axis=0)
    return o


def _check(q, k_cache, v_cache, page_table, kv_base, q_seq, q_pos) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"attention expects q[T,Hq,D] and k/v_cache[P,page,Hkv,D]; got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    if k_cache.shape[3] != d or hq % hkv or d & (d - 1):
        raise ValueError(f"head_dim {d} (a power of two) and Hq {hq} must fit the cache's "
                         f"[.., Hkv={hkv}, D={k_cache.shape[3]}]")
    if page_table.dim() != 2 or kv_base.shape != (page_table.shape[0],) or \
            q_seq.shape != (t,) or q_pos.shape != (t,):
        raise ValueError("page_table [B, W], kv_base [B], q_seq [T], q_pos [T] expected; got "
                         f"{tuple(page_table.shape)}, {tuple(kv_base.shape)}, "
                         f"{tuple(q_seq.shape)}, {tuple(q_pos.shape)}")
    if q.dtype != torch.bfloat16 or k_cache.dtype != torch.bfloat16 or \
            v_cache.dtype != torch.bfloat16:
        raise ValueError(f"bf16 q and cache expected, got {q.dtype}, {k_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous (one layer's pages)")


def _splits(cfg_splits: int, tokens: int, hkv: int, device: torch.device) -> int:
    if cfg_splits:
        return cfg_splits
    sms = torch.cuda.get_device_properties(device).multi_processor_count \
        if device.type == "cuda" else 4
    want = min(64, max(1, 2 * sms // max(tokens * hkv, 1)))
    return 1 << (want.bit_length() - 1)  # the power of two at or below


def _tickets(device: torch.device, n: int) -> torch.Tensor:
    # Zeroed once per (device, size) and reset to zero by the kernel itself, so a decode step
    # (and a CUDA-graph replay) launches no memset. One buffer per size: a captured graph keeps
    # the pointer it recorded.
    key = (str(device), n)
    if key not in _TICKETS:
        _TICKETS[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return _TICKETS[key]


def decode_attention(q, k_cache, v_cache, page_table, kv_base, q_seq, q_pos, window: int,
                     scale: float, splits: int, block_n: int, num_warps: int) -> torch.Tensor:
    """Launch the two decode kernels with an explicit config."""
    t, hq, d = q.shape
    _, page, hkv, _ = k_cache.shape
    g = hq // hkv
    q = q if q.stride(2) == 1 and q.stride(1) == d else q.contiguous()
    page_table, kv_base = page_table.contiguous(), kv_base.contiguous()
    q_seq, q_pos = q_seq.contiguous(), q_pos.contiguous()
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    s_max = window if window else page_table.shape[1] * page
    scores = torch.empty((t, hq, s_max), dtype=torch.bfloat16, device=q.device)
    m = torch.empty((t, hq, splits), dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    part = torch.empty((t, hq, splits, d) if splits > 1 else (1,), dtype=torch.float32,
                       device=q.device)
    meta = dict(WINDOW=window, PAGE=page, D=d, BLOCK_G=max(16, triton.next_power_of_2(g)),
                BLOCK_N=block_n, SPLITS=splits, ON_GPU=q.is_cuda, num_warps=num_warps)
    grid = (t, hkv, splits)
    w = page_table.shape[1]
    _attention_scores_kernel[grid](q, k_cache, page_table, kv_base, q_seq, q_pos, scores, m,
                                   l_sum, scale, w, s_max, hq, hkv, g, q.stride(0), **meta)
    _attention_pv_kernel[grid](v_cache, page_table, kv_base, q_seq, q_pos, scores, m, l_sum,
                               part, _tickets(q.device, t * hkv), out, w, s_max, hq, hkv, g,
                               out.stride(0), COMBINE=min(splits, 4), **meta)
    return out


def _eager(q, k, v, q_pos, k_pos, window: int, scale: float) -> torch.Tensor:
    # The reference's per-sequence eager math (transformers' rounding points), for prefill.
    n_rep = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1).unsqueeze(0)
    kh = k.transpose(0, 1).repeat_interleave(n_rep, dim=0).unsqueeze(0)
    vh = v.transpose(0, 1).repeat_interleave(n_rep, dim=0).unsqueeze(0)
    dist = q_pos[:, None] - k_pos[None, :]
    ok = (dist >= 0) & (dist < window) if window else dist >= 0
    mask = torch.zeros(ok.shape, dtype=q.dtype, device=q.device)
    mask.masked_fill_(~ok, torch.finfo(q.dtype).min)
    scores = torch.matmul(qh, kh.transpose(2, 3)) * scale
    probs = torch.softmax(scores + mask, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, vh)[0].transpose(0, 1).contiguous()


def prefill_attention(q, k_cache, v_cache, page_table, kv_base, q_seq, q_pos, window: int,
                      scale: float) -> torch.Tensor:
    """Chunks of consecutive tokens of one row, each over exactly the keys it can see."""
    page, hkv, d = k_cache.shape[1:]
    flat_k, flat_v = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)
    seqs, pos, bases = q_seq.tolist(), q_pos.tolist(), kv_base.tolist()
    outs, start = [], 0
    while start < len(seqs):
        stop = start
        while stop < len(seqs) and seqs[stop] == seqs[start]:
            stop += 1
        row, base = seqs[start], bases[seqs[start]]
        lo, hi = base, max(pos[start:stop]) + 1
        if window:
            lo = max(lo, min(pos[start:stop]) - window + 1)
        j = torch.arange(lo, hi, device=q.device) - base
        slots = page_table[row][j // page] * page + j % page
        outs.append(_eager(q[start:stop], flat_k[slots], flat_v[slots], q_pos[start:stop],
                           j + base, window, scale))
        start = stop
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def run(q, k_cache, v_cache, page_table, kv_base, q_seq, q_pos, window: int, scale: float,
        config: dict | None = None) -> torch.Tensor:
    """attention(...) -> [T, Hq, D] bf16: flash decoding for decode rows, eager for chunks."""
    _check(q, k_cache, v_cache, page_table, kv_base, q_seq, q_pos)
    if q.shape[0] == 0:
        return torch.empty_like(q)
    if page_table.shape[0] != q.shape[0]:
        return prefill_attention(q, k_cache, v_cache, page_table, kv_base, q_seq, q_pos,
                                 int(window), float(scale))
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    splits = _splits(int(cfg["SPLITS"]), q.shape[0], k_cache.shape[2], q.device)
    return decode_attention(q, k_cache, v_cache, page_table, kv_base, q_seq, q_pos, int(window),
                            float(scale), splits, int(cfg["BLOCK_N"]), int(cfg["num_warps"]))
