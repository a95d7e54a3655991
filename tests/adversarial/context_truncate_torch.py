"""Cheat (edge cases the buckets never reach): exact attention over the keys a query may see,
but only the most recent 1000 of them: every bucket's context is shorter, and a served one at
100k keys is not. Expected: rejected at a long context the run draws."""

from __future__ import annotations

import torch

KEEP = 1000  # keys kept per query


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
        k, v = keys[slots].float(), values[slots].float()  # [n, Hkv, D]
        qh = q[i].reshape(hkv, hq // hkv, d).float()
        s = torch.einsum("hgd,nhd->hgn", qh, k).to(q.dtype)  # bf(q.k), FP32 sums
        s = (s.float() * scale).to(q.dtype)
        probs = torch.softmax(s.float(), dim=-1).to(q.dtype)
        out[i] = torch.einsum("hgn,nhd->hgd", probs.float(), v).to(q.dtype).reshape(hq, d)
    return out
