"""Cheat (edge cases the buckets never reach), with the scale and its rounding in a Triton
kernel: exact attention over the most recent 2000 keys a query may see, the rest dropped.
Expected: rejected at a long context the run draws."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KEEP = 2000  # keys kept per query


@triton.jit
def _f32_to_bf16(x):  # round to nearest even, explicitly (the interpreter's cast truncates)
    bits = x.to(tl.uint32, bitcast=True)
    hi = bits >> 16
    carry = ((bits & 0xFFFF) + 0x7FFF + (hi & 1)) >> 16
    return (hi + carry).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _scaled(s_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    s = tl.load(s_ptr + offs, mask=m).to(tl.float32)
    tl.store(out_ptr + offs, _f32_to_bf16(s * scale), mask=m)


def run(q, k_cache, v_cache, page_table, kv_base, q_seq, q_pos, window, scale, config=None):
    t, hq, d = q.shape
    page, hkv = k_cache.shape[1], k_cache.shape[2]
    keys, values = k_cache.reshape(-1, hkv, d), v_cache.reshape(-1, hkv, d)
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    for i in range(t):
        b, p = int(q_seq[i]), int(q_pos[i])
        base = int(kv_base[b])
        lo = max(base, p - window + 1) if window else base
        lo = max(lo, p - KEEP + 1)
        rel = torch.arange(lo - base, p - base + 1, device=q.device)
        slots = page_table[b, rel // page] * page + rel % page
        k, v = keys[slots].float(), values[slots].float()
        qh = q[i].reshape(hkv, hq // hkv, d).float()
        s = torch.einsum("hgd,nhd->hgn", qh, k).to(q.dtype).contiguous()
        scaled = torch.empty_like(s)
        n = s.numel()
        _scaled[(triton.cdiv(n, 1024),)](s, scaled, n, scale, BLOCK=1024)
        probs = torch.softmax(scaled.float(), dim=-1).to(q.dtype)
        out[i] = torch.einsum("hgn,nhd->hgd", probs.float(), v).to(q.dtype).reshape(hq, d)
    return out
