"""The fused KV-cache write and the attention variants inside the serving engine (CPU, BF16).

Two engines run the same requests in lockstep: one with every op's reference (the cache written
by `index_copy_`, as the runtime did before the write moved into the Q/K norm ops), one with the
fused Triton variants under the interpreter. After every step their caches must be identical,
bit for bit, in both pools: pages of 1, 4 and 5 slots, a window of 5 keys (window pages given
back while serving), chunked prefill, and preemption (pages freed and handed to other sequences).
Then the whole block of variants (Q/K norm with the write, split-K GEMV, flash-decoding
attention, through the CUDA-graph route's padded static buffers) decodes the reference's greedy
tokens.
"""

from __future__ import annotations

import pytest
import torch

from model.config import preset
from model.demo import write_demo_checkpoint
from model.ops import CONTRACTS, OpTable
from model.registry import Registry
from model.serve.engine import EngineConfig, LLMEngine, SamplingParams
from model.serve.engine.kv_cache import FULL, SWA
from model.serve.graphs import DecodeGraphs

# Two sliding-window layers (window 5) and one full-attention layer, dense MLPs.
CFG = preset("tiny").replace(num_hidden_layers=3, sliding_window=5)
GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("kv"), config=CFG, seed=4)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(2)
    # Shorter and longer than the window, across page edges, one a single token.
    return [torch.randint(8, 2048, (n,), generator=g).tolist() for n in (1, 6, 13, 9)]


def _variants(*names: tuple[str, str]) -> dict:
    reg = Registry()
    return {op: reg.load_variant(op, v).run for op, v in names}


FUSED_WRITE = (("qk_norm_rope", "template_rows_v2"), ("qk_norm_ssmax", "template_rows_v2"))
BLOCK = FUSED_WRITE + (("attention", "triton_v1"), ("qkv_gate_proj", "triton_v1"))


def _engine(ckpt, impls: dict | None = None, **kw) -> LLMEngine:
    kw = {"max_num_seqs": 4, "max_model_len": 48, "page_size": 4, "max_num_batched_tokens": 7,
          "kv_cache_bytes": 2 * 2**20, **kw}
    eng = LLMEngine(EngineConfig(model=str(ckpt), dtype="bfloat16", kernels="reference",
                                 device="cpu", **kw))
    if impls:
        eng.model.set_ops(OpTable(impls))  # each variant's run, its DEFAULT_CONFIG
        assert all(eng.model.ops.impl(op) is not CONTRACTS[op].reference for op in impls)
    return eng


def _assert_same_cache(a: LLMEngine, b: LLMEngine, step: int) -> None:
    for group in (FULL, SWA):
        for name, x, y in (("k", a.cache.k[group], b.cache.k[group]),
                           ("v", a.cache.v[group], b.cache.v[group])):
            diff = int((x.view(torch.int16) != y.view(torch.int16)).sum())
            assert diff == 0, f"step {step}: {group} {name} cache differs in {diff} elements"


def _lockstep(ckpt, prompts, impls, **kw) -> tuple[LLMEngine, int]:
    ref, fused = _engine(ckpt, **kw), _engine(ckpt, impls, **kw)
    for eng in (ref, fused):
        for i, p in enumerate(prompts):
            eng.add_request(str(i), p, GREEDY)
    steps = 0
    while ref.has_unfinished() or fused.has_unfinished():
        ref.step()
        fused.step()
        steps += 1
        held = [[(p.length, p.full, p.swa) for p in e.cache.seqs.values()] for e in (ref, fused)]
        assert held[0] == held[1]  # the same pages, allocated and freed alike
        _assert_same_cache(ref, fused, steps)
    return ref, steps


@pytest.mark.slow
@pytest.mark.parametrize("page,chunk", [(4, 7), (5, 3), (1, 16)])
def test_fused_kv_write_leaves_the_reference_cache(ckpt, prompts, page, chunk):
    ref, steps = _lockstep(ckpt, prompts, _variants(*FUSED_WRITE), page_size=page,
                           max_num_batched_tokens=chunk)
    assert steps >= GREEDY.max_tokens and ref.stats().num_preemptions == 0


@pytest.mark.slow
def test_fused_kv_write_through_preemption(ckpt, prompts):
    # 7 usable full-attention pages of 4 slots for 4 requests of up to 18 tokens: running
    # sequences are preempted, their pages freed and given to others, and recomputed later.
    lay = _engine(ckpt).cache.layout
    budget = lay.swa_reserve(4, 7, 24) * lay.page_bytes(SWA) + 8 * lay.page_bytes(FULL)
    ref, _ = _lockstep(ckpt, prompts, _variants(*FUSED_WRITE), kv_cache_bytes=budget,
                       max_model_len=24)
    assert ref.stats().num_preemptions > 0


@pytest.mark.slow
def test_block_variants_decode_the_reference_tokens(ckpt, prompts):
    want = [r.token_ids for r in _engine(ckpt).generate(prompts, GREEDY)]
    eng = _engine(ckpt, _variants(*BLOCK))
    eng.runner.batched_decode = True
    graphs = DecodeGraphs(eng.runner, max_num_seqs=4)
    graphs.ready, graphs.replay = True, False  # the padded static-buffer forward, eagerly
    eng.runner.graphs = graphs
    calls = []
    run = graphs.run
    graphs.run = lambda chunks, replay=None: calls.append(len(chunks)) or run(chunks, replay)
    assert [r.token_ids for r in eng.generate(prompts, GREEDY)] == want
    assert calls and max(calls) > 1  # batched decode steps went through the padded buffers
    eng.cache.check_no_leaks(set())
