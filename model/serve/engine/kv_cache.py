"""Paged KV cache with two lifetimes: full-attention layers keep every token, sliding-window
layers keep only the last `window` tokens and give pages back as tokens leave the window.

Each lifetime has its own page pool. A page id names one `page_size`-token page in *every* layer
of its group, so a sequence has one page table per group, not one per layer:
    k[group], v[group]: [layers_in_group, num_pages, page_size, Hkv, D]
Layer-major, so one layer's pages are a contiguous [num_pages, page_size, Hkv, D] buffer (what a
paged attention kernel reads) and flatten to [num_pages * page_size, Hkv, D] for slot writes.
Page 0 of each pool is the null page: never handed out; padded rows of a CUDA-graph batch write
there. The cache starts zeroed because masked keys still meet V in P.V, and 0 * NaN is NaN.

A sequence's pages cover its `length` tokens (the tokens computed or being computed this step).
For a chunk of n new tokens starting at position s the window pool must hold keys
[s - window + 1, s + n); between steps, [length - window + 1, length), which is at most
ceil((window - 1) / page_size) + 1 pages (`KVLayout.swa_pages_between_steps`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

FULL, SWA = "full", "swa"


@dataclass(frozen=True)
class KVLayout:
    """Which layers keep which lifetime, and the shape of one token's K/V in each group."""

    full_layers: tuple[int, ...]
    swa_layers: tuple[int, ...]
    window: int  # keys per query incl. itself; 0 when there is no sliding-window layer
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.swa_layers and self.window < 1:
            raise ValueError("sliding-window layers need window >= 1")

    @classmethod
    def for_model(cls, cfg, shard, page_size: int, dtype: torch.dtype) -> KVLayout:
        """Layout of a BeamConfig at a rank's shard shapes (layers with no window are full)."""
        full = tuple(i for i in range(cfg.num_hidden_layers) if not cfg.window(i))
        swa = tuple(i for i in range(cfg.num_hidden_layers) if cfg.window(i))
        return cls(full, swa, cfg.sliding_window if swa else 0, page_size,
                   shard.num_key_value_heads, cfg.head_dim, dtype)

    def layers(self, group: str) -> tuple[int, ...]:
        return self.full_layers if group == FULL else self.swa_layers

    def token_bytes(self, group: str) -> int:
        """K and V of one token in every layer of the group."""
        item = torch.empty((), dtype=self.dtype).element_size()
        return len(self.layers(group)) * 2 * self.num_kv_heads * self.head_dim * item

    def page_bytes(self, group: str) -> int:
        return self.token_bytes(group) * self.page_size

    @property
    def swa_pages_between_steps(self) -> int:
        return math.ceil((self.window - 1) / self.page_size) + 1 if self.swa_layers else 0

    def swa_reserve(self, max_num_seqs: int, max_num_batched_tokens: int,
                    max_model_len: int) -> int:
        """Window pages (incl. the null page) so that the window pool never limits admission.

        A chunk of n tokens needs ceil((window - 1 + n) / page) + 1 pages, which is at most
        ceil((window - 1) / page) + 2 + (n - 1) / page; summed over the running sequences that is
        below max_num_seqs * (ceil((window - 1) / page) + 2) + max_num_batched_tokens / page.
        """
        if not self.swa_layers:
            return 0
        per_seq = min(math.ceil((self.window - 1) / self.page_size) + 2,
                      math.ceil(max_model_len / self.page_size) + 1)
        return 1 + max_num_seqs * per_seq + math.ceil(max_num_batched_tokens / self.page_size)


class PagePool:
    """Free list of page ids 1..num_pages-1 (0 is the null page)."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, 0, -1))  # a stack: low ids are handed out first

    @property
    def num_usable(self) -> int:
        return max(self.num_pages - 1, 0)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"page pool exhausted: asked {n}, {len(self._free)} free "
                               "(the scheduler must call can_allocate first)")
        taken = self._free[len(self._free) - n:][::-1]
        del self._free[len(self._free) - n:]
        return taken

    def give(self, ids: list[int]) -> None:
        self._free.extend(reversed(ids))


@dataclass
class SeqPages:
    length: int = 0  # tokens covered
    # Page of logical page i. Only ever extended while the sequence lives (free() drops the
    # whole object): DecodeGraphs rewrites a static table row only from a new list or new tail.
    full: list[int] = field(default_factory=list)
    swa: list[int] = field(default_factory=list)  # page of logical page swa_first + i
    swa_first: int = 0


class PagedKVCache:
    """Page tables per sequence over one K and one V tensor per lifetime group."""

    def __init__(self, layout: KVLayout, num_full_pages: int, num_swa_pages: int,
                 device: str | torch.device = "cpu") -> None:
        self.layout = layout
        self.device = torch.device(device)
        self.pools = {FULL: PagePool(num_full_pages if layout.full_layers else 0),
                      SWA: PagePool(num_swa_pages if layout.swa_layers else 0)}
        self.k: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        for group in (FULL, SWA):
            n = self.pools[group].num_pages
            shape = (len(layout.layers(group)), n, layout.page_size, layout.num_kv_heads,
                     layout.head_dim)
            self.k[group] = torch.zeros(shape, dtype=layout.dtype, device=self.device)
            self.v[group] = torch.zeros(shape, dtype=layout.dtype, device=self.device)
        self._where = {layer: (FULL, j) for j, layer in enumerate(layout.full_layers)}
        self._where.update({layer: (SWA, j) for j, layer in enumerate(layout.swa_layers)})
        self.seqs: dict[int, SeqPages] = {}

    @classmethod
    def from_budget(cls, layout: KVLayout, budget_bytes: int, max_num_seqs: int,
                    max_num_batched_tokens: int, max_model_len: int,
                    device: str | torch.device = "cpu") -> PagedKVCache:
        """Reserve window pages for every running sequence; the rest of the budget holds
        full-attention pages, which bound the total context the cache can hold."""
        swa_pages = layout.swa_reserve(max_num_seqs, max_num_batched_tokens, max_model_len)
        left = budget_bytes - swa_pages * layout.page_bytes(SWA)
        full_pages = left // layout.page_bytes(FULL) if layout.full_layers else 0
        need = math.ceil(max_model_len / layout.page_size) + 1
        if layout.full_layers and full_pages < need:
            raise ValueError(
                f"a KV cache budget of {budget_bytes / 2**20:.1f} MiB holds "
                f"{max(full_pages - 1, 0) * layout.page_size} tokens of full-attention context "
                f"after reserving {swa_pages} sliding-window pages for max_num_seqs="
                f"{max_num_seqs}, fewer than max_model_len={max_model_len}; raise "
                "gpu_memory_utilization / kv_cache_bytes, or lower max_model_len or max_num_seqs")
        return cls(layout, int(full_pages), swa_pages, device)

    # ---- capacity -------------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        """Tokens of context the cache holds over all sequences (the full-attention pool)."""
        group = FULL if self.layout.full_layers else SWA
        return self.pools[group].num_usable * self.layout.page_size

    def usage(self) -> float:
        """Fraction of the fuller pool in use."""
        fracs = [1 - p.num_free / p.num_usable for p in self.pools.values() if p.num_usable]
        return max(fracs, default=0.0)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.k, self.v) for t in d.values())

    # ---- allocation -----------------------------------------------------------------------
    def _plan(self, seq_id: int, n: int) -> tuple[int, int, int, int]:
        """(new full pages, new window pages, window pages dropped, first logical page kept)."""
        pages = self.seqs.get(seq_id) or SeqPages()
        size, length, window = self.layout.page_size, pages.length, self.layout.window
        new_full = 0
        if self.layout.full_layers:
            new_full = math.ceil((length + n) / size) - len(pages.full)
        if not self.layout.swa_layers:
            return new_full, 0, 0, 0
        lo = max(0, length - window + 1) // size  # first key of the first new query
        hi = (length + n - 1) // size
        held_last = pages.swa_first + len(pages.swa) - 1
        dropped = min(max(lo - pages.swa_first, 0), len(pages.swa))
        new_swa = hi - max(lo, held_last + 1) + 1 if pages.swa else hi - lo + 1
        return new_full, max(new_swa, 0), dropped, lo

    def can_allocate(self, seq_id: int, n: int) -> bool:
        """Whether `n` more tokens of this sequence fit now (pages it drops count as free)."""
        new_full, new_swa, dropped, _ = self._plan(seq_id, n)
        return (new_full <= self.pools[FULL].num_free
                and new_swa <= self.pools[SWA].num_free + dropped)

    def allocate(self, seq_id: int, n: int) -> None:
        if not self.can_allocate(seq_id, n):
            raise RuntimeError(f"sequence {seq_id}: {n} more tokens do not fit the KV cache "
                               "(call can_allocate first)")
        new_full, new_swa, _, lo = self._plan(seq_id, n)
        pages = self.seqs.setdefault(seq_id, SeqPages())
        if self.layout.swa_layers:
            self._drop_swa_below(pages, lo)
            if not pages.swa:
                pages.swa_first = lo
            pages.swa.extend(self.pools[SWA].take(new_swa))
        pages.full.extend(self.pools[FULL].take(new_full))
        pages.length += n

    def trim(self, seq_id: int) -> None:
        """Give back window pages that no future query of the sequence can see."""
        pages = self.seqs.get(seq_id)
        if pages is not None and self.layout.swa_layers:
            lo = max(0, pages.length - self.layout.window + 1) // self.layout.page_size
            self._drop_swa_below(pages, lo)

    def _drop_swa_below(self, pages: SeqPages, logical: int) -> None:
        k = min(max(logical - pages.swa_first, 0), len(pages.swa))
        if k:
            self.pools[SWA].give(pages.swa[:k])
            del pages.swa[:k]
            pages.swa_first += k

    def free(self, seq_id: int) -> None:
        pages = self.seqs.pop(seq_id, None)
        if pages is not None:
            self.pools[FULL].give(pages.full)
            self.pools[SWA].give(pages.swa)

    def length(self, seq_id: int) -> int:
        pages = self.seqs.get(seq_id)
        return pages.length if pages else 0

    # ---- addressing ------------------------------------------------------------------------
    def layer_cache(self, layer: int) -> tuple[str, torch.Tensor, torch.Tensor]:
        """(group, k, v) of one layer, each [num_pages, page_size, Hkv, D]."""
        group, j = self._where[layer]
        return group, self.k[group][j], self.v[group][j]

    def slots(self, seq_id: int, group: str, start: int, stop: int) -> list[int]:
        """Flat slots (page * page_size + offset) of positions [start, stop) in a group's pool."""
        pages, size = self.seqs[seq_id], self.layout.page_size
        if not self.layout.layers(group):
            return [0] * (stop - start)
        if group == FULL:
            return [pages.full[p // size] * size + p % size for p in range(start, stop)]
        first = pages.swa_first
        if start // size < first or (stop - 1) // size >= first + len(pages.swa):
            raise IndexError(f"sequence {seq_id}: positions [{start}, {stop}) are not in its "
                             f"window pages (logical pages {first}..{first + len(pages.swa) - 1})")
        return [pages.swa[p // size - first] * size + p % size for p in range(start, stop)]

    def page_tables(self, seq_id: int) -> tuple[list[int], list[int], int]:
        """(full pages, window pages, first position covered by the window pages)."""
        pages = self.seqs[seq_id]
        return pages.full, pages.swa, pages.swa_first * self.layout.page_size

    # ---- accounting (tests) -----------------------------------------------------------------
    def num_pages_held(self, seq_id: int) -> tuple[int, int]:
        pages = self.seqs.get(seq_id)
        return (len(pages.full), len(pages.swa)) if pages else (0, 0)

    def check_no_leaks(self, live_seq_ids: set[int] | None = None) -> None:
        """Every usable page is free or held by exactly one live sequence; raises otherwise."""
        if live_seq_ids is not None and set(self.seqs) - live_seq_ids:
            raise RuntimeError(f"pages held by finished sequences {set(self.seqs) - live_seq_ids}")
        for group, pool in self.pools.items():
            held = [p for s in self.seqs.values() for p in (s.full if group == FULL else s.swa)]
            every = held + pool._free
            if len(every) != len(set(every)) or sorted(every) != list(range(1, pool.num_pages)):
                raise RuntimeError(
                    f"{group} pool leaks or double-books pages: {len(held)} held + "
                    f"{pool.num_free} free != {pool.num_usable} usable, or a page is listed twice")
