"""On a CUDA GPU: decode steps captured in CUDA graphs give what the same padded forward gives
eagerly, and whole generations with graphs equal those without. Capture needs a capturable
moe_experts (the reference syncs with the host): these engines lock grouped_mm_v2."""

from __future__ import annotations

import pytest
import torch

from model.demo import write_demo_checkpoint
from model.registry import current_arch
from model.serve.engine import EngineConfig, LLMEngine, SamplingParams

from .registry_support import lock_shipped

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo"), "tiny", seed=6)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(8)
    return [torch.randint(8, 2048, (n,), generator=g).tolist() for n in (1, 5, 17, 40, 23, 64)]


@pytest.fixture(scope="module")
def moe_lock(tmp_path_factory):
    """A registry whose lock selects only moe_experts grouped_mm_v2 for this GPU's arch (every
    other op: the reference); tests/test_kernels_moe.py verifies the variant itself."""
    root = tmp_path_factory.mktemp("registry")
    return str(lock_shipped(root, "moe_experts", "grouped_mm_v2", current_arch("cuda")).root)


def gpu_engine(path, graphs: bool, registry: str | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), device="cuda", dtype="bfloat16",
                                  kernels="tuned" if registry else "reference",
                                  registry=registry, max_num_seqs=8, max_model_len=160,
                                  max_num_batched_tokens=64, cuda_graphs=graphs,
                                  kv_cache_bytes=256 * 2**20))


def test_reference_moe_is_not_captured_and_says_why(demo) -> None:
    eng = gpu_engine(demo, graphs=True)
    assert eng.runner.graphs is None
    assert any("moe_experts runs its reference" in n for n in eng.runner.notes), eng.runner.notes


def test_capture_succeeds(demo, moe_lock) -> None:
    eng = gpu_engine(demo, graphs=True, registry=moe_lock)
    assert eng.runner.graphs is not None, eng.runner.notes
    assert any("captured" in n for n in eng.runner.notes)
    assert eng.cache.capacity_tokens >= 160


def test_graph_replay_equals_the_same_forward_run_eagerly(demo, prompts, moe_lock) -> None:
    eng = gpu_engine(demo, graphs=True, registry=moe_lock)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts[:5]):
        eng.add_request(str(i), p, params)
    while any(not s.is_decoding for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    graphs = eng.runner.graphs
    for _ in range(8):  # bucket 8 holds the 5 decodes plus 3 padded rows
        out = eng.scheduler.schedule()
        chunks = out.chunks
        assert len(chunks) == 5 and graphs.covers(chunks)
        replayed = graphs.run(chunks, replay=True)
        eager = graphs.run(chunks, replay=False)  # rewrites the same K/V at the same slots
        # Same kernels on the same padded shapes; allow for a non-deterministic reduction.
        torch.testing.assert_close(replayed, eager, atol=1e-3, rtol=0)
        assert replayed.argmax(-1).tolist() == eager.argmax(-1).tolist()
        eng.scheduler.advance(out)
        for c, t in zip(chunks, eager.argmax(-1).tolist()):
            c.seq.output_ids.append(t)


def test_generation_with_graphs_equals_eager(demo, prompts, moe_lock) -> None:
    eng = gpu_engine(demo, graphs=True, registry=moe_lock)
    for params in (SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                   SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=5,
                                  ignore_eos=True)):
        eng.runner.graphs.replay = True
        replayed = [r.token_ids for r in eng.generate(prompts, params)]
        eng.runner.graphs.replay = False  # the same padded decode forward, run eagerly
        eager = [r.token_ids for r in eng.generate(prompts, params)]
        assert replayed == eager
    eng.cache.check_no_leaks(set())


def test_graph_engine_agrees_with_a_plain_eager_engine(demo, prompts, moe_lock) -> None:
    # Without graphs the reference MoE runs (not grouped_mm_v2) and decode tables are as wide as
    # the batch needs: BF16 results agree up to reduction order, so only the first token, from
    # the prefill logits, is compared exactly; the logits closely.
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5, ignore_eos=True)
    with_graphs = gpu_engine(demo, graphs=True, registry=moe_lock).generate(prompts, params)
    plain = gpu_engine(demo, graphs=False).generate(prompts, params)
    for a, b in zip(with_graphs, plain):
        assert a.token_ids == b.token_ids
        assert a.logprobs[0].logprob == pytest.approx(b.logprobs[0].logprob, abs=0.05)
