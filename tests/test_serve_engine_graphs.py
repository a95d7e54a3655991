"""The pieces CUDA-graph decode is made of, checked on the CPU: the attention reference's decode
form against its per-sequence form, the padded static-buffer decode forward (what a graph
replays) against eager decode, and that an op whose reference syncs with the host blocks
capture, saying why (the capturable moe_experts variants are tested in test_kernels_moe.py)."""

from __future__ import annotations

import pytest
import torch

from model.demo import write_demo_checkpoint
from model.ops import OpTable
from model.ops.attention import eager_attention
from model.ops.attention import reference as attention_ref
from model.serve.engine import EngineConfig, LLMEngine, SamplingParams
from model.serve.graphs import DecodeGraphs, batch_buckets, uncapturable

from .registry_support import lock_shipped, resolve


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(0)


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_match_per_sequence_attention(gen, window: int, dtype: torch.dtype) -> None:
    # The attention reference's capture-safe form (one padded page-table row per query) against
    # its per-sequence form over exactly the visible keys.
    page, hq, hkv, d, n_pages = 4, 4, 2, 16, 20
    k_pages = torch.randn(n_pages, page, hkv, d, generator=gen).to(dtype)
    v_pages = torch.randn(n_pages, page, hkv, d, generator=gen).to(dtype)
    lengths = [1, 7, 13]  # keys 0..len-1, pages in a scrambled order
    perm = torch.randperm(n_pages - 1, generator=gen) + 1
    tables, used = [], 0
    for n in lengths:
        need = -(-n // page)
        tables.append(perm[used:used + need].tolist() + [0] * (4 - need))
        used += need
    q = torch.randn(len(lengths), hq, d, generator=gen).to(dtype)
    q_pos = torch.tensor([n - 1 for n in lengths])
    args = (q, k_pages, v_pages, torch.tensor(tables), torch.zeros(3, dtype=torch.long),
            torch.arange(3), q_pos, window, d**-0.5)
    out = attention_ref(*args)
    for b, n in enumerate(lengths):
        pages = torch.tensor(tables[b][: -(-n // page)])
        k = k_pages[pages].reshape(-1, hkv, d)[:n]
        v = v_pages[pages].reshape(-1, hkv, d)[:n]
        ref = eager_attention(q[b:b + 1], k, v, q_pos[b:b + 1], torch.arange(n), window, d**-0.5)
        # Masked padding keys add exact zeros; only the summation length differs.
        torch.testing.assert_close(out[b:b + 1], ref, atol=1e-5 if dtype == torch.float32
                                   else 1e-2, rtol=1e-3)


def test_reference_moe_blocks_capture_and_a_locked_variant_does_not(tmp_path) -> None:
    assert uncapturable(OpTable()) == ["moe_experts runs its reference, which loops over the "
                                       "experts present (a host sync)"]
    reg = lock_shipped(tmp_path / "registry", "moe_experts", "grouped_mm_v2", "cpu")
    ops, refused = resolve(reg)
    assert not refused and ops.sources["moe_experts"].startswith("grouped_mm_v2")
    assert uncapturable(ops) == []


def test_batch_buckets() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]


def test_static_padded_decode_equals_eager(tmp_path) -> None:
    path = write_demo_checkpoint(tmp_path / "demo", "tiny", seed=1)
    eng = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32",
                                 kernels="reference", max_num_seqs=8, max_model_len=64,
                                 page_size=4, max_num_batched_tokens=64,
                                 kv_cache_bytes=4 * 2**20))
    eng.runner.batched_decode = True
    g = torch.Generator().manual_seed(3)
    for i, n in enumerate([3, 17, 30]):
        eng.add_request(str(i), torch.randint(8, 2048, (n,), generator=g).tolist(),
                        SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    while any(not s.is_decoding for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    graphs = DecodeGraphs(eng.runner, max_num_seqs=8)
    for _ in range(3):
        out = eng.scheduler.schedule()
        chunks = out.chunks
        assert len(chunks) == 3 and all(c.num_tokens == 1 for c in chunks)
        static = graphs.run(chunks, replay=False)  # padded to bucket 4, full table 16 wide
        eager = eng.runner.execute_eager(chunks)  # rewrites the same K/V at the same slots
        # Padding keys are masked to exact zeros; FP32 sums of different lengths may differ.
        torch.testing.assert_close(static, eager, atol=1e-5, rtol=1e-5)
        assert static.argmax(-1).tolist() == eager.argmax(-1).tolist()
        eng.scheduler.advance(out)
        for c, t in zip(chunks, eager.argmax(-1).tolist()):
            c.seq.output_ids.append(t)
    eng.cache.check_no_leaks({s.seq_id for s in eng.scheduler.running})


def test_generation_through_the_graph_path_equals_eager(tmp_path) -> None:
    # The runner's CUDA-graph route (bucket padding, static buffers, logits selection), with the
    # padded forward run eagerly instead of replayed: the CPU stands in for the GPU here.
    path = write_demo_checkpoint(tmp_path / "demo", "tiny", seed=2)
    config = EngineConfig(model=str(path), device="cpu", dtype="float32", kernels="reference",
                          max_num_seqs=6, max_model_len=80, page_size=4,
                          max_num_batched_tokens=10, kv_cache_bytes=4 * 2**20)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(8, 2048, (n,), generator=g).tolist() for n in (1, 9, 18, 33, 5)]
    params = SamplingParams(max_tokens=15, temperature=0, ignore_eos=True)
    plain = [r.token_ids for r in LLMEngine(config).generate(prompts, params)]
    eng = LLMEngine(config)
    eng.runner.batched_decode = True
    graphs = DecodeGraphs(eng.runner, max_num_seqs=6)
    graphs.ready, graphs.replay = True, False
    eng.runner.graphs = graphs
    calls = []
    run = graphs.run
    graphs.run = lambda chunks, replay=None: calls.append(len(chunks)) or run(chunks, replay)
    assert [r.token_ids for r in eng.generate(prompts, params)] == plain
    assert len(calls) > 10 and max(calls) == 5


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_static_page_tables_follow_the_cache_as_sequences_come_and_go(seed: int) -> None:
    """`DecodeGraphs.load` keeps the host full-attention table from step to step and writes only
    what changed: after every step of a random schedule (decodes, sequences joining, finishing,
    preempted and re-admitted under the same id, rows reordered, the batch shrinking into a
    padded bucket) the static tables equal ones built from the cache's page lists."""
    from types import SimpleNamespace

    from model.serve.engine.kv_cache import KVLayout, PagedKVCache
    from model.serve.paged_attention import pad_rows

    layout = KVLayout((0, 2), (1,), window=7, page_size=4, num_kv_heads=1, head_dim=2,
                      dtype=torch.float32)
    cache = PagedKVCache(layout, num_full_pages=400, num_swa_pages=200)
    graphs = DecodeGraphs(SimpleNamespace(cache=cache, device=torch.device("cpu"),
                                          max_model_len=120), max_num_seqs=8)
    rng = torch.Generator().manual_seed(seed)

    def draw(n: int) -> int:
        return int(torch.randint(0, n, (1,), generator=rng))

    def admit(seq_id: int, n: int) -> None:
        cache.allocate(seq_id, n)
        cache.trim(seq_id)

    live: list[int] = []
    next_id = 0
    rewrites = 0
    for _step in range(60):
        op = draw(10)
        if (op < 2 or not live) and len(live) < 8:
            admit(next_id, 1 + draw(40))
            live.append(next_id)
            next_id += 1
        elif op == 2 and len(live) > 1:
            cache.free(live.pop(draw(len(live))))
        elif op == 3:  # preempted, then re-admitted with its tokens recomputed (new pages)
            s = live[draw(len(live))]
            n = cache.length(s)
            cache.free(s)
            admit(s, n)
        elif op == 4:
            live = [live[i] for i in torch.randperm(len(live), generator=rng).tolist()]
        for s in live:  # this step's decode token
            if cache.length(s) < 118:
                admit(s, 1)
        chunks = [SimpleNamespace(seq_id=s, start=cache.length(s) - 1, num_tokens=1,
                                  token_ids=[7]) for s in live]
        before = graphs._full_host.clone()
        b = graphs.load(chunks)
        rewrites += int((graphs._full_host != before).any(dim=1).sum())
        tables = [cache.page_tables(s) for s in live]
        want_full = pad_rows([t[0] for t in tables], graphs.full_width)
        want_full += [[0] * graphs.full_width] * (b - len(live))
        want_swa = pad_rows([t[1] for t in tables], graphs.swa_width)
        want_swa += [[0] * graphs.swa_width] * (b - len(live))
        assert graphs.full_table[:b].tolist() == want_full
        assert graphs.swa_table[:b].tolist() == want_swa
        assert graphs.swa_base[:len(live)].tolist() == [t[2] for t in tables]
        assert graphs.full_write[:len(live)].tolist() == [
            cache.slots(s, "full", cache.length(s) - 1, cache.length(s))[0] for s in live]
    assert next_id > 3 and rewrites > 0


def test_a_page_table_too_wide_for_the_graphs_is_refused() -> None:
    from types import SimpleNamespace

    from model.serve.engine.kv_cache import KVLayout, PagedKVCache

    layout = KVLayout((0,), (), window=0, page_size=4, num_kv_heads=1, head_dim=2,
                      dtype=torch.float32)
    cache = PagedKVCache(layout, num_full_pages=40, num_swa_pages=0)
    graphs = DecodeGraphs(SimpleNamespace(cache=cache, device=torch.device("cpu"),
                                          max_model_len=16), max_num_seqs=2)
    cache.allocate(0, 30)  # 8 pages; the graphs' tables hold 4
    chunk = SimpleNamespace(seq_id=0, start=29, num_tokens=1, token_ids=[1])
    with pytest.raises(ValueError, match="does not fit width 4"):
        graphs.load([chunk])
