"""The paged KV cache as the op contracts see it: one layer's pages and where tokens go in them.

A layer's cache is `k_cache, v_cache [P, page, Hkv, D]` (P pages of `page` token slots; the
serving runtime's `PagedKVCache.layer_cache`). A token's slot is `page_id * page + offset`, so
`slots[T]` (the slot mapping) names where each new token's K and V are written, and a page table
row `page_table[b, :]` with `kv_base[b]` (the position of the first slot of the row's first page)
names where sequence b's key at position j sits:
    slot(b, j) = page_table[b, (j - kv_base[b]) // page] * page + (j - kv_base[b]) % page
`qk_norm_rope` / `qk_norm_ssmax` write the cache; `attention` reads it.
"""

from __future__ import annotations

import torch

from ._contract import Shape, randn

DEFAULT_PAGE = 16


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
                slots: torch.Tensor) -> None:
    """Shapes a cache write needs; a clear error otherwise."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [P, page, Hkv, D]; got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if tuple(k_cache.shape[2:]) != tuple(k.shape[1:]):
        raise ValueError(f"cache token shape {tuple(k_cache.shape[2:])} != the new keys' "
                         f"{tuple(k.shape[1:])} [Hkv, D]")
    if slots.shape != (k.shape[0],) or slots.dtype.is_floating_point:
        raise ValueError(f"slots must be integer [{k.shape[0]}] (one slot per token), got "
                         f"{tuple(slots.shape)} {slots.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous (one layer's pages)")


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """k_cache/v_cache[slot of token t] = k[t], v[t] (bit copies), as the runtime did before the
    write moved into the Q/K norm ops."""
    check_cache(k_cache, v_cache, k, slots)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


def cache_inputs(shape: Shape, g: torch.Generator, dtype: torch.dtype, device
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random (never zero: untouched slots must pass through) k/v caches and distinct random
    slots for T tokens: P pages of `page` (defaults: enough pages for the tokens and a few more,
    pages of 16), slots scattered over every page, page 0 included."""
    t, hkv, d = shape["T"], shape["Hkv"], shape["D"]
    page = int(shape.get("page", DEFAULT_PAGE))
    pages = int(shape.get("P", -(-t // page) + 3))
    pages += pages == t  # never T pages: the verifier may hand token-major tensors as views
    if pages * page < t:
        raise ValueError(f"{pages} pages of {page} cannot hold {t} distinct slots")
    k_cache = randn((pages, page, hkv, d), g, dtype, device)
    v_cache = randn((pages, page, hkv, d), g, dtype, device)
    slots = torch.randperm(pages * page, generator=g)[:t].to(device)
    return k_cache, v_cache, slots


def cache_bytes(shape: Shape) -> int:
    """Bytes of one cache write: read v, write k and v (BF16), read the int64 slots."""
    n = shape["T"] * shape["Hkv"] * shape["D"]
    return 2 * 3 * n + 8 * shape["T"]
