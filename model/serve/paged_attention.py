"""Attention over the paged KV cache: the `AttentionBackend` the runner plugs into the model.

A step's tokens (decodes and prefill chunks, any mix) are described once per step, per
lifetime pool (full-attention / sliding-window), by `PoolMeta`: every sequence's page-table row,
the position its first page starts at, and the slot of each new token. Per layer the model asks
`kv_cache` for the layer's pages and the step's slots (the Q/K norm op writes K and V there),
then attends through the `attention` op over the same pages: which kernel runs is the registry's
choice for that op (model/ops/attention.py has the contract; `--attention-backend` picks a
variant, model/serve/attention_backends.py). Shapes are static for a decode step of a given
batch, and nothing syncs with the host, so CUDA graphs can capture it (model/serve/graphs.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from .engine.kv_cache import FULL, SWA, PagedKVCache


@dataclass(frozen=True)
class PoolMeta:
    """One pool's view of a step: row b of `page_table` is chunk b's pages (padded with the null
    page 0), `kv_base[b]` the position of its first page's first slot, `slots[t]` where token t's
    K and V go."""

    page_table: torch.Tensor  # [B, W] int64
    kv_base: torch.Tensor  # [B] int64
    slots: torch.Tensor  # [T] int64


@dataclass
class PagedBatch:
    """A step's flat tokens, chunk by chunk (`seq_bounds`); `num_decode` single-token chunks
    come first where the runner orders them so."""

    positions: torch.Tensor  # [T] int64
    seq_bounds: Sequence[tuple[int, int]]
    q_seq: torch.Tensor  # [T] int64: the page-table row (chunk) of each token
    pools: Mapping[str, PoolMeta]  # FULL and SWA
    num_decode: int = 0


def check_width(rows: Sequence[Sequence[int]], width: int) -> None:
    """Raise unless every page-table row fits `width` pages."""
    if any(len(r) > width for r in rows):
        raise ValueError(f"a page-table row of {max(len(r) for r in rows)} pages does not fit "
                         f"width {width}")


def pad_rows(rows: Sequence[Sequence[int]], width: int) -> list[list[int]]:
    """Page-table rows padded with the null page 0 to `width`."""
    check_width(rows, width)
    return [list(r) + [0] * (width - len(r)) for r in rows]


class PagedAttention:
    """AttentionBackend over a PagedKVCache; `ops()` gives the model's current OpTable."""

    def __init__(self, cache: PagedKVCache, ops: Callable[[], object]) -> None:
        self.cache = cache
        self.ops = ops

    def kv_cache(self, layer: int, v: torch.Tensor, batch: PagedBatch):
        group, k_pages, v_pages = self.cache.layer_cache(layer)
        return k_pages, v_pages, batch.pools[group].slots

    def __call__(self, layer: int, q: torch.Tensor, window: int, scale: float,
                 batch: PagedBatch) -> torch.Tensor:
        group, k_pages, v_pages = self.cache.layer_cache(layer)
        want = self.cache.layout.window if group == SWA else 0
        if window != want:
            raise ValueError(f"layer {layer} asks window {window}, its {group} pool keeps "
                             f"window {want}")
        meta = batch.pools[group]
        return self.ops().attention(q, k_pages, v_pages, meta.page_table, meta.kv_base,
                                    batch.q_seq, batch.positions, window, scale)


__all__ = ["FULL", "SWA", "PagedAttention", "PagedBatch", "PoolMeta", "pad_rows"]
