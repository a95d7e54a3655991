"""Paged KV cache: page counts of both lifetimes, window release, capacity math, no leaks."""

from __future__ import annotations

import math
import random

import pytest
import torch

from model.config import preset
from model.serve.engine.kv_cache import FULL, SWA, KVLayout, PagedKVCache


def layout(window: int = 16, page: int = 4, full=(5, 7), swa=(0, 1, 2, 3, 4, 6)) -> KVLayout:
    return KVLayout(tuple(full), tuple(swa), window, page, 2, 32, torch.float32)


@pytest.fixture
def rng() -> random.Random:
    return random.Random(1234)


def test_layout_of_beam_preset_groups_layers_by_window() -> None:
    cfg = preset("beam-1.0-501b")
    lay = KVLayout.for_model(cfg, cfg.shard(8), 16, torch.bfloat16)
    assert len(lay.full_layers) == 9 and len(lay.swa_layers) == 43
    assert lay.window == 512 and lay.num_kv_heads == 1
    # One token of the 9 full layers: K and V, 1 KV head of 128, BF16.
    assert lay.token_bytes(FULL) == 9 * 2 * 1 * 128 * 2
    assert lay.page_bytes(SWA) == 43 * 2 * 128 * 2 * 16
    assert lay.swa_pages_between_steps == math.ceil(511 / 16) + 1


@pytest.mark.parametrize("page", [1, 4, 5, 16])
@pytest.mark.parametrize("window", [1, 7, 16])
def test_window_pages_are_released_during_decode(page: int, window: int) -> None:
    lay = layout(window, page)
    cache = PagedKVCache(lay, 200, 100)
    cache.allocate(0, 1)
    for length in range(2, 120):
        cache.allocate(0, 1)
        cache.trim(0)
        full, swa = cache.num_pages_held(0)
        assert full == math.ceil(length / page)
        # The window pages cover keys [length - window + 1, length) and nothing older.
        first = max(0, length - window + 1) // page
        assert swa == (length - 1) // page - first + 1
        assert swa <= lay.swa_pages_between_steps
        _, pages, start = cache.page_tables(0)
        assert start == first * page and len(pages) == swa
    cache.free(0)
    assert cache.pools[FULL].num_free == 199 and cache.pools[SWA].num_free == 99
    cache.check_no_leaks(set())


@pytest.mark.parametrize("chunk", [1, 7, 17, 123])
def test_prefill_chunk_holds_its_window_then_trims(chunk: int) -> None:
    lay = layout(window=16, page=4)
    cache = PagedKVCache(lay, 400, 200)
    length = 0
    while length < 300:
        cache.allocate(0, chunk)
        # During the step: keys [start - window + 1, start + chunk) must be addressable.
        lo = max(0, length - 15)
        slots = cache.slots(0, SWA, lo, length + chunk)
        assert len(set(slots)) == len(slots)
        length += chunk
        cache.trim(0)
        assert cache.num_pages_held(0)[1] <= lay.swa_pages_between_steps
    with pytest.raises(IndexError):
        cache.slots(0, SWA, 0, 1)  # long gone from the window


def test_slots_are_unique_across_sequences_and_pages_are_shared_by_layers() -> None:
    lay = layout(window=8, page=4)
    cache = PagedKVCache(lay, 64, 64)
    for seq, n in enumerate([3, 9, 17]):
        cache.allocate(seq, n)
    full = [s for seq, n in enumerate([3, 9, 17]) for s in cache.slots(seq, FULL, 0, n)]
    assert len(set(full)) == len(full) and min(full) >= 4  # page 0 is the null page
    group, k, v = cache.layer_cache(7)
    assert group == FULL and k.shape == (64, 4, 2, 32)
    assert k.data_ptr() == cache.k[FULL][1].data_ptr()  # layer 7 is the 2nd full layer


def test_capacity_math_from_a_byte_budget() -> None:
    lay = layout(window=16, page=4)
    max_seqs, batched, max_len = 3, 10, 64
    swa = lay.swa_reserve(max_seqs, batched, max_len)
    assert swa == 1 + max_seqs * (math.ceil(15 / 4) + 2) + math.ceil(10 / 4)
    full_pages = 40
    budget = swa * lay.page_bytes(SWA) + full_pages * lay.page_bytes(FULL) + 5  # 5 spare bytes
    cache = PagedKVCache.from_budget(lay, budget, max_seqs, batched, max_len)
    assert cache.pools[FULL].num_pages == full_pages
    assert cache.capacity_tokens == (full_pages - 1) * 4
    assert cache.nbytes() == budget - 5
    with pytest.raises(ValueError, match="max_model_len"):
        PagedKVCache.from_budget(lay, budget, max_seqs, batched, full_pages * 4)


def test_window_reservation_never_limits_admission(rng: random.Random) -> None:
    # Any mix of running sequences within max_num_seqs and the token budget fits the window pool.
    lay = layout(window=16, page=4)
    max_seqs, batched = 6, 23
    swa = lay.swa_reserve(max_seqs, batched, 10_000)
    cache = PagedKVCache(lay, 400, swa)
    for _ in range(200):
        for seq in range(max_seqs):
            cache.free(seq)
        budget = batched
        for seq in range(max_seqs):
            past = rng.randrange(0, 200)
            while cache.length(seq) < past:  # earlier steps, in chunks within the budget
                cache.allocate(seq, min(batched, past - cache.length(seq)))
                cache.trim(seq)
            n = rng.randint(1, max(1, budget)) if budget else 0
            if n:
                assert cache.can_allocate(seq, n)
                cache.allocate(seq, n)
                budget -= n


def test_can_allocate_counts_pages_it_would_drop() -> None:
    lay = layout(window=4, page=4, full=())
    cache = PagedKVCache(lay, 0, 4)  # 3 usable window pages
    cache.allocate(0, 12)  # pages for keys 0..11: all 3
    assert cache.pools[SWA].num_free == 0
    assert cache.can_allocate(0, 4)  # keys 9..15 need pages 2 and 3; pages 0, 1 go back
    cache.allocate(0, 4)
    assert cache.num_pages_held(0) == (0, 2)
    assert not cache.can_allocate(1, 5)


def test_no_leaks_after_random_allocations(rng: random.Random) -> None:
    lay = layout(window=8, page=4)
    cache = PagedKVCache(lay, 60, 40)
    live: set[int] = set()
    for step in range(3000):
        seq = rng.randrange(12)
        if seq in live and rng.random() < 0.2:
            cache.free(seq)
            live.discard(seq)
        else:
            n = rng.choice([1, 1, 1, 3, 7])
            if cache.can_allocate(seq, n):
                cache.allocate(seq, n)
                cache.trim(seq)
                live.add(seq)
            else:
                with pytest.raises(RuntimeError):
                    cache.allocate(seq, n)
        if step % 100 == 0:
            cache.check_no_leaks(live)
    for seq in list(live):
        cache.free(seq)
    cache.check_no_leaks(set())
    assert cache.usage() == 0.0
