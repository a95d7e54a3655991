"""attention: split-KV flash decoding over the paged KV cache at the eager rounding points.

# {{HEADER}}

Contract (model/ops/attention.py): query t of page-table row b = q_seq[t] at position p =
q_pos[t] sees the keys j of row b with lo <= j <= p, lo = kv_base[b], or max(kv_base[b],
p - window + 1) on sliding-window layers; key j sits in slot page_table[b, (j - kv_base[b]) //
PAGE] * PAGE + (j - kv_base[b]) % PAGE. GQA: query head g*G..g*G+G-1 read KV head g (G = Hq/Hkv,
6 at Beam's TP8 rank); the G heads of one KV head share one program, so K and V are read once
per KV head.

Decode (one page-table row per query, B == T): two launches over a grid (T, Hkv, SPLITS). Each
row cuts the n keys it sees into ns = cdiv(n, chunk) contiguous chunks, chunk = max(MIN_BLOCKS,
cdiv(cdiv(n, SPLITS), BLOCK_N)) * BLOCK_N: the splits follow the row's own context (a 512-key
window, a 1k context, a 128k one), not the page table's width, and programs past a row's ns
return at once. Within a chunk, the next block's K (or V and scores) is in flight while the
current block is computed.
  1. scores: s = bf(q . k) (FP32 accumulation), s' = bf(f32(s) * scale), stored BF16 to a
     workspace; per split the running max m_i and sum l_i = sum exp(s' - m_i) (online).
  2. P.V: m = max_i m_i, l = sum_i l_i * exp(m_i - m) (a fixed tree over the splits);
     P = bf(exp(s' - m) / l) (IEEE divide); the split's partial o_i = sum P . v in FP32. Then a
     two-level combine by atomic tickets, in a fixed order whatever order programs finish in:
     the last program of each group of GROUP splits sums the group's partials (chunks of
     COMBINE, in order), the last group sums the group sums in group order, and rounds once:
     out = bf(sum_groups sum_i o_i). A row with one split stores its output directly.
Rounding points kept, as the eager reference: BF16 scores, BF16 scaled scores, masking by
exclusion (the reference's additive finfo.min mask underflows exp to exactly 0), FP32 softmax
(exact max, expf, IEEE divide) rounded to BF16, BF16 P.V operands with FP32 accumulation and one
rounding. What differs is reduction order only: q.k over D (tensor-core order), the softmax sum
(online per split, then rescaled per split) and P.V over the keys (per split, then summed). The
split count depends on the config and, with SPLITS 0, on T: a row's bits may differ by an ulp
between batch sizes (never between runs).
Keys a query may not see are never read, so stale or unwritten slots cannot reach the output.
Prefill and mixed steps (B < T) run the reference's own per-sequence eager math in torch (the
same rounding points); this variant targets decode.
Memory traffic (decode): per (token, KV head) the visible K and V once (2 * n * D bf16), q and the
output, the page-table entries, plus the BF16 score workspace written and read (2 * G * n bf16,
~5% of K/V at G = 6) and the FP32 split partials (ns * G * D, written and read back from L2).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

CONFIG_SPACE = {"SPLITS": [0, 1, 2, 4, 8, 16, 32, 64, 128, 256], "BLOCK_N": [16, 32, 64, 128],
                "MIN_BLOCKS": [1, 2, 4, 8], "GROUP": [4, 8, 16], "num_warps": [2, 4, 8]}
# SPLITS: the most splits a row may take (the grid's third axis); 0 = about PROGRAMS_PER_SM
# programs per SM from T * Hkv, at most AUTO_MAX_SPLITS, and never more than the longest row
# the page table (or the window) can hold needs. Each row takes only the splits its own context
# needs, chunks of at least MIN_BLOCKS blocks of BLOCK_N keys. GROUP: splits summed by one
# program at the first level of the combine.
DEFAULT_CONFIG = {"SPLITS": 0, "BLOCK_N": 64, "MIN_BLOCKS": 2, "GROUP": 8, "num_warps": 4}
WINDOW_CONFIG = {"BLOCK_N": 32}
PROGRAMS_PER_SM = 2
AUTO_MAX_SPLITS = 128
ARCHS = None  # any: Triton on CUDA GPUs, the interpreter on the CPU
_TICKETS: dict[tuple[str, int], torch.Tensor] = {}


# {{common.bf16_to_f32}}: _bf16_to_f32


# {{common.f32_to_bf16}}: _f32_to_bf16


# {{common.exp}}: _exp


# {{common.dot}}: _dot


@triton.jit
def _key_range(q_seq_ptr, q_pos_ptr, base_ptr, t, split, WINDOW: tl.constexpr,
               SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, MIN_BLOCKS: tl.constexpr):
    # (row, first visible key, this split's [start, end), the row's kv_base, the row's split
    # count ns): the row's own n visible keys in chunks of whole blocks, at least MIN_BLOCKS.
    row = tl.load(q_seq_ptr + t)
    p = tl.load(q_pos_ptr + t)
    base = tl.load(base_ptr + row)
    lo = base
    if WINDOW > 0:
        lo = tl.maximum(base, p - WINDOW + 1)
    n = p + 1 - lo
    chunk = tl.maximum(tl.cdiv(tl.cdiv(n, SPLITS), BLOCK_N), MIN_BLOCKS) * BLOCK_N
    ns = tl.maximum(tl.cdiv(n, chunk), 1)  # one split (writing zeros) for an empty row
    start = lo + split * chunk
    end = tl.minimum(start + chunk, p + 1)
    return row, lo, start, end, base, ns


@triton.jit
def _slots(table_ptr, row, base, j, valid, W, PAGE: tl.constexpr):
    rel = j - base
    page = tl.load(table_ptr + row * W + rel // PAGE, mask=valid, other=0)
    return (page * PAGE + rel % PAGE).to(tl.int64)


@triton.jit
def _attention_scores_kernel(q_ptr, k_ptr, table_ptr, base_ptr, q_seq_ptr, q_pos_ptr, s_ptr,
                             m_ptr, l_ptr, scale, W, SMAX, HQ, HKV, G, q_st,
                             WINDOW: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr,
                             BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                             SPLITS: tl.constexpr, MIN_BLOCKS: tl.constexpr,
                             ON_GPU: tl.constexpr):
    t, h, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row, lo, start, end, base, ns = _key_range(q_seq_ptr, q_pos_ptr, base_ptr, t, split, WINDOW,
                                               SPLITS, BLOCK_N, MIN_BLOCKS)
    if split < ns:
        g = tl.arange(0, BLOCK_G)
        gmask = g < G
        d = tl.arange(0, D)
        nb = tl.arange(0, BLOCK_N)
        heads = (h * G + g).to(tl.int64)
        q = tl.load(q_ptr + t.to(tl.int64) * q_st + heads[:, None] * D + d[None, :],
                    mask=gmask[:, None], other=0.0)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        acc_l = tl.zeros([BLOCK_G], tl.float32)
        srow = s_ptr + (t.to(tl.int64) * HQ + heads) * SMAX  # [BLOCK_G] score rows
        # Prefetch: block i's K is in flight and block i+1's slots are known while block i-1
        # is computed.
        slot = _slots(table_ptr, row, base, start + nb, start + nb < end, W, PAGE)
        k = tl.load(k_ptr + (slot * HKV + h)[:, None] * D + d[None, :],
                    mask=(start + nb < end)[:, None], other=0.0)
        j1 = start + BLOCK_N + nb
        slot = _slots(table_ptr, row, base, j1, j1 < end, W, PAGE)
        for kb in range(start, end, BLOCK_N):
            j, jn, jnn = kb + nb, kb + BLOCK_N + nb, kb + 2 * BLOCK_N + nb
            k_next = tl.load(k_ptr + (slot * HKV + h)[:, None] * D + d[None, :],
                             mask=(jn < end)[:, None], other=0.0)
            slot = _slots(table_ptr, row, base, jnn, jnn < end, W, PAGE)
            valid = j < end
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
            k = k_next
        stat = (t.to(tl.int64) * HQ + heads) * SPLITS + split
        tl.store(m_ptr + stat, m, mask=gmask)
        tl.store(l_ptr + stat, acc_l, mask=gmask)


@triton.jit
def _softmax_stats(m_ptr, l_ptr, t, heads, gmask, ns, HQ, SPLITS: tl.constexpr,
                   ON_GPU: tl.constexpr):
    # The global max and sum from the row's ns split stats (m_i, l_i), in split order.
    sp = tl.arange(0, SPLITS)
    stat = ((t.to(tl.int64) * HQ + heads) * SPLITS)[:, None] + sp[None, :]
    use = gmask[:, None] & (sp < ns)[None, :]
    m_i = tl.load(m_ptr + stat, mask=use, other=float("-inf"))
    l_i = tl.load(l_ptr + stat, mask=use, other=0.0)
    m = tl.max(m_i, axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)  # padded head rows, empty rows
    scaled = tl.where(m_i == float("-inf"), 0.0, l_i * _exp(m_i - m[:, None], ON_GPU))
    total = tl.where(gmask, tl.sum(scaled, axis=1), 1.0)  # the same tree in every program
    return m, total


@triton.jit
def _attention_pv_kernel(v_ptr, table_ptr, base_ptr, q_seq_ptr, q_pos_ptr, s_ptr, m_ptr, l_ptr,
                         part_ptr, gpart_ptr, ticket_ptr, out_ptr, W, SMAX, HQ, HKV, G, o_st,
                         WINDOW: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                         SPLITS: tl.constexpr, MIN_BLOCKS: tl.constexpr, GROUP: tl.constexpr,
                         COMBINE: tl.constexpr, ON_GPU: tl.constexpr):
    t, h, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row, lo, start, end, base, ns = _key_range(q_seq_ptr, q_pos_ptr, base_ptr, t, split, WINDOW,
                                               SPLITS, BLOCK_N, MIN_BLOCKS)
    if split < ns:
        g = tl.arange(0, BLOCK_G)
        gmask = g < G
        d = tl.arange(0, D)
        nb = tl.arange(0, BLOCK_N)
        heads = (h * G + g).to(tl.int64)
        m, total = _softmax_stats(m_ptr, l_ptr, t, heads, gmask, ns, HQ, SPLITS, ON_GPU)
        acc = tl.zeros([BLOCK_G, D], tl.float32)
        srow = s_ptr + (t.to(tl.int64) * HQ + heads) * SMAX
        # Prefetch as in the scores pass: block i's V and scores in flight while i-1 computes.
        slot = _slots(table_ptr, row, base, start + nb, start + nb < end, W, PAGE)
        v = tl.load(v_ptr + (slot * HKV + h)[:, None] * D + d[None, :],
                    mask=(start + nb < end)[:, None], other=0.0)
        keep = gmask[:, None] & (start + nb < end)[None, :]
        s = tl.load(srow[:, None] + (start + nb - lo)[None, :], mask=keep, other=0.0)
        j1 = start + BLOCK_N + nb
        slot = _slots(table_ptr, row, base, j1, j1 < end, W, PAGE)
        for kb in range(start, end, BLOCK_N):
            j, jn, jnn = kb + nb, kb + BLOCK_N + nb, kb + 2 * BLOCK_N + nb
            v_next = tl.load(v_ptr + (slot * HKV + h)[:, None] * D + d[None, :],
                             mask=(jn < end)[:, None], other=0.0)
            keep_next = gmask[:, None] & (jn < end)[None, :]
            s_next = tl.load(srow[:, None] + (jn - lo)[None, :], mask=keep_next, other=0.0)
            slot = _slots(table_ptr, row, base, jnn, jnn < end, W, PAGE)
            keep = gmask[:, None] & (j < end)[None, :]
            p = tl.div_rn(_exp(_bf16_to_f32(s) - m[:, None], ON_GPU), total[:, None])
            p = tl.where(keep, p, 0.0)
            acc += _dot(_f32_to_bf16(p), v, ON_GPU)  # P rounded to BF16, FP32 accumulation
            v, s = v_next, s_next
        _finish(acc, part_ptr, gpart_ptr, ticket_ptr, out_ptr, t, h, split, ns, HQ, HKV, G,
                o_st, D, BLOCK_G, BLOCK_H, SPLITS, GROUP, COMBINE)


@triton.jit
def _finish(acc, part_ptr, gpart_ptr, ticket_ptr, out_ptr, t, h, split, ns, HQ, HKV, G, o_st,
            D: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_H: tl.constexpr,
            SPLITS: tl.constexpr, GROUP: tl.constexpr, COMBINE: tl.constexpr):
    # One split: round and store. Otherwise store the FP32 partial and take the group's ticket;
    # the group's last program sums its partials, the last group sums the group sums. Tickets
    # are taken after a barrier (every thread's stores first) with acq_rel at GPU scope, and
    # each combiner resets its ticket to 0 for the next call (and CUDA-graph replay).
    g = tl.arange(0, BLOCK_G)
    gmask = g < G
    d = tl.arange(0, D)
    heads = (h * G + g).to(tl.int64)
    hh = tl.arange(0, BLOCK_H)
    hmask = hh < G
    hrow = t.to(tl.int64) * HQ + h * G + hh  # [BLOCK_H] the heads' rows
    out_h = out_ptr + t.to(tl.int64) * o_st + (h * G + hh).to(tl.int64)[:, None] * D + d[None, :]
    if ns == 1:
        out = out_ptr + t.to(tl.int64) * o_st + heads[:, None] * D + d[None, :]
        tl.store(out, _f32_to_bf16(acc), mask=gmask[:, None])
    else:
        NG: tl.constexpr = (SPLITS + GROUP - 1) // GROUP
        part = part_ptr + (((t.to(tl.int64) * HQ + heads) * SPLITS)[:, None] + split) * D
        tl.store(part + d[None, :], acc, mask=gmask[:, None])
        tl.debug_barrier()  # every thread's partial is stored before the ticket is taken
        grp = split // GROUP
        ng = tl.cdiv(ns, GROUP)
        size = tl.minimum(ns - grp * GROUP, GROUP)
        tickets = ticket_ptr + (t * HKV + h) * (NG + 1)
        ticket = tl.atomic_add(tickets + grp, 1, sem="acq_rel", scope="gpu")
        if ticket == size - 1:  # the group's last split sums the group
            o = _sum_rows(part_ptr, hrow * SPLITS, hmask, grp * GROUP, size, D, BLOCK_H,
                          COMBINE)
            tl.atomic_xchg(tickets + grp, 0)
            if ng == 1:
                tl.store(out_h, _f32_to_bf16(o), mask=hmask[:, None])
            else:
                gpart = gpart_ptr + ((hrow * NG)[:, None] + grp) * D + d[None, :]
                tl.store(gpart, o, mask=hmask[:, None])
                tl.debug_barrier()
                last = tl.atomic_add(tickets + NG, 1, sem="acq_rel", scope="gpu")
                if last == ng - 1:  # the last group sums the groups, in group order
                    o = _sum_rows(gpart_ptr, hrow * NG, hmask, 0, ng, D, BLOCK_H, COMBINE)
                    tl.store(out_h, _f32_to_bf16(o), mask=hmask[:, None])
                    tl.atomic_xchg(tickets + NG, 0)


@triton.jit
def _sum_rows(ptr, rows, hmask, first, count, D: tl.constexpr, BLOCK_H: tl.constexpr,
              COMBINE: tl.constexpr):
    # sum_{i < count} ptr[rows + first + i, :D] per head row, FP32: COMBINE rows per load (a
    # tree inside, chunks in order), read from L2 (.cg: other programs wrote them).
    c = tl.arange(0, COMBINE)
    d = tl.arange(0, D)
    o = tl.zeros([BLOCK_H, D], tl.float32)
    for i0 in range(0, count, COMBINE):
        idx = (rows[None, :] + first + i0 + c[:, None])[:, :, None]  # [COMBINE, BLOCK_H, 1]
        mask = hmask[None, :, None] & (i0 + c < count)[:, None, None]
        x = tl.load(ptr + idx * D + d[None, None, :], mask=mask, other=0.0, cache_modifier=".cg")
        o += tl.sum(x, axis=0)
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



def grid_splits(cfg_splits: int, rows: int, max_keys: int, block_n: int, min_blocks: int,
                sms: int) -> int:
    """The grid's split axis (a power of two): the config's, or about PROGRAMS_PER_SM programs
    per SM over the `rows` = T * Hkv (token, KV head) pairs, at most AUTO_MAX_SPLITS; never more
    than a row of `max_keys` keys (the page table's width, or the window) can use. Each row then
    takes only the splits its own context needs (`row_splits`, the kernels' `_key_range`)."""
    if cfg_splits:
        want = triton.next_power_of_2(cfg_splits)
    else:  # the power of two at or below
        want = min(AUTO_MAX_SPLITS, max(1, PROGRAMS_PER_SM * sms // max(rows, 1)))
        want = 1 << (want.bit_length() - 1)
    most = max(1, -(-max_keys // (block_n * min_blocks)))
    return min(want, triton.next_power_of_2(most))


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (4 stand-ins on the CPU)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def row_splits(keys: int, splits: int, block_n: int, min_blocks: int) -> int:
    """How many splits a row with `keys` visible keys takes (as the kernels' `_key_range`)."""
    per_split = -(-keys // splits)
    chunk = max(-(-per_split // block_n), min_blocks) * block_n
    return max(1, -(-keys // chunk))


def _tickets(device: torch.device, n: int) -> torch.Tensor:
    # Zeroed once per (device, size) and reset to zero by the kernel itself, so a decode step
    # (and a CUDA-graph replay) launches no memset. One buffer per size: a captured graph keeps
    # the pointer it recorded.
    key = (str(device), n)
    if key not in _TICKETS:
        _TICKETS[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return _TICKETS[key]


def decode_attention(q, k_cache, v_cache, page_table, kv_base, q_seq, q_pos, window: int,
                     scale: float, config: dict) -> torch.Tensor:
    """Launch the two decode kernels with a full config (DEFAULT_CONFIG's keys)."""
    t, hq, d = q.shape
    _, page, hkv, _ = k_cache.shape
    g = hq // hkv
    block_n, min_blocks, group = (int(config[k]) for k in ("BLOCK_N", "MIN_BLOCKS", "GROUP"))
    q = q if q.stride(2) == 1 and q.stride(1) == d else q.contiguous()
    page_table, kv_base = page_table.contiguous(), kv_base.contiguous()
    q_seq, q_pos = q_seq.contiguous(), q_pos.contiguous()
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    w = page_table.shape[1]
    s_max = min(window, w * page) if window else w * page
    splits = grid_splits(int(config["SPLITS"]), t * hkv, s_max, block_n, min_blocks,
                         sm_count(q.device))
    group = min(group, splits)
    n_groups = -(-splits // group)
    scores = torch.empty((t, hq, s_max), dtype=torch.bfloat16, device=q.device)
    m = torch.empty((t, hq, splits), dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    f32 = dict(dtype=torch.float32, device=q.device)
    part = torch.empty((t, hq, splits, d) if splits > 1 else (1,), **f32)
    gpart = torch.empty((t, hq, n_groups, d) if n_groups > 1 else (1,), **f32)
    meta = dict(WINDOW=window, PAGE=page, D=d, BLOCK_G=max(16, triton.next_power_of_2(g)),
                BLOCK_N=block_n, SPLITS=splits, MIN_BLOCKS=min_blocks, ON_GPU=q.is_cuda,
                num_warps=int(config["num_warps"]))
    grid = (t, hkv, splits)
    _attention_scores_kernel[grid](q, k_cache, page_table, kv_base, q_seq, q_pos, scores, m,
                                   l_sum, scale, w, s_max, hq, hkv, g, q.stride(0), **meta)
    _attention_pv_kernel[grid](v_cache, page_table, kv_base, q_seq, q_pos, scores, m, l_sum,
                               part, gpart, _tickets(q.device, t * hkv * (n_groups + 1)), out,
                               w, s_max, hq, hkv, g, out.stride(0),
                               BLOCK_H=triton.next_power_of_2(g), GROUP=group,
                               COMBINE=min(group, 8), **meta)
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
    # Window layers read at most a window of keys: narrower blocks split them finer (a sweep on
    # an H200: 11.9 us against 15.2 at batch 1, 12.5 against 16.2 at batch 8).
    cfg = {**DEFAULT_CONFIG, **(WINDOW_CONFIG if window else {}), **(config or {})}
    return decode_attention(q, k_cache, v_cache, page_table, kv_base, q_seq, q_pos, int(window),
                            float(scale), cfg)
