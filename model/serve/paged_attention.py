"""Attention over the paged KV cache: the `AttentionBackend` the runner plugs into the model.

Every call first writes the step's new K/V at their slots, then attends each query to the keys
its sequence has cached. Two paths give the same result up to reduction order:
- per sequence, through the model's `attention` op (the reference, or a registry kernel) on the
  gathered keys: prefill chunks always, and decodes on the CPU;
- batched decode: one padded gather of every decoding sequence's pages and one masked attention
  with the reference's rounding points (BF16 scores, scaled in BF16, FP32 softmax rounded to BF16,
  BF16 P.V). Static shapes and no host syncs, so CUDA graphs can capture it. Padding keys carry
  positions after the query, so the causal mask removes them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .engine.kv_cache import SWA, PagedKVCache


@dataclass
class DecodeMeta:
    """Page tables of the first `B` (single-token) sequences of a batch, padded with page 0."""

    full_table: torch.Tensor  # [B, Pf] int64
    swa_table: torch.Tensor  # [B, Ps] int64
    swa_base: torch.Tensor  # [B] int64: position of swa_table[:, 0]'s first slot


@dataclass
class SeqKeys:
    """Where one (non-batched) sequence's keys live: flat slots and the first key position."""

    full_slots: torch.Tensor  # [S_full] int64, positions 0..S_full-1
    swa_slots: torch.Tensor  # [S_swa] int64, positions swa_start..
    swa_start: int


@dataclass
class PagedBatch:
    """A step's flat tokens: `num_decode` single-token sequences first, then the others."""

    positions: torch.Tensor  # [T] int64
    seq_bounds: Sequence[tuple[int, int]]
    full_write: torch.Tensor  # [T] int64 slot of each new token in the full pool
    swa_write: torch.Tensor  # [T] int64 slot in the window pool
    num_decode: int = 0
    decode: DecodeMeta | None = None
    keys: Sequence[SeqKeys] = ()  # one per sequence after the batched decodes


def decode_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
                     table: torch.Tensor, base: torch.Tensor | int, q_pos: torch.Tensor,
                     window: int, scale: float) -> torch.Tensor:
    """q [B, Hq, D] against the pages `table` [B, P] of k/v_pages [N, page, Hkv, D] -> [B, Hq, D].

    Key j of row b sits at position base[b] + j. Rounding as the `attention` reference.
    """
    b, hq, d = q.shape
    _, page, hkv, _ = k_pages.shape
    k = k_pages[table].reshape(b, -1, hkv, d)  # [B, S, Hkv, D]
    v = v_pages[table].reshape(b, -1, hkv, d)
    k_pos = torch.arange(k.shape[1], device=q.device)[None, :]
    k_pos = k_pos + (base[:, None] if isinstance(base, torch.Tensor) else base)
    dist = q_pos[:, None] - k_pos  # [B, S]
    ok = dist >= 0
    if window:
        ok = ok & (dist < window)
    mask = torch.zeros(ok.shape, dtype=q.dtype, device=q.device)
    mask.masked_fill_(~ok, torch.finfo(q.dtype).min)
    qh = q.view(b, hkv, hq // hkv, d)  # query head h reads KV head h // (Hq / Hkv)
    scores = torch.matmul(qh, k.permute(0, 2, 3, 1)) * scale  # [B, Hkv, rep, S]
    probs = torch.softmax(scores + mask[:, None, None, :], dim=-1, dtype=torch.float32)
    out = torch.matmul(probs.to(q.dtype), v.permute(0, 2, 1, 3))  # [B, Hkv, rep, D]
    return out.reshape(b, hq, d)


class PagedAttention:
    """AttentionBackend over a PagedKVCache; `ops()` gives the model's current OpTable."""

    def __init__(self, cache: PagedKVCache, ops: Callable[[], object]) -> None:
        self.cache = cache
        self.ops = ops

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 window: int, scale: float, batch: PagedBatch) -> torch.Tensor:
        group, k_pages, v_pages = self.cache.layer_cache(layer)
        swa = group == SWA
        slots = batch.swa_write if swa else batch.full_write
        flat_k = k_pages.view(-1, *k_pages.shape[2:])  # [N * page, Hkv, D]
        flat_v = v_pages.view(-1, *v_pages.shape[2:])
        flat_k.index_copy_(0, slots, k)
        flat_v.index_copy_(0, slots, v)
        parts = []
        nd = batch.num_decode
        if nd:
            meta = batch.decode
            table, base = (meta.swa_table, meta.swa_base) if swa else (meta.full_table, 0)
            parts.append(decode_attention(q[:nd], k_pages, v_pages, table, base,
                                          batch.positions[:nd], window, scale))
        attention = self.ops().attention
        for keys, (start, stop) in zip(batch.keys, batch.seq_bounds[nd:]):
            slots_i = keys.swa_slots if swa else keys.full_slots
            first = keys.swa_start if swa else 0
            k_pos = torch.arange(first, first + slots_i.numel(), device=q.device)
            parts.append(attention(q[start:stop], flat_k[slots_i], flat_v[slots_i],
                                   batch.positions[start:stop], k_pos, window, scale))
        return parts[0] if len(parts) == 1 else torch.cat(parts)
