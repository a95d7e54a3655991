"""AsyncEngine: streams equal the sync engine's output, concurrent requests, errors before
queuing, aborts from the caller and from a closed iterator, shutdown."""

from __future__ import annotations

import asyncio

import pytest
import torch

from model.demo import write_demo_checkpoint
from model.serve.engine import (
    AsyncEngine,
    EngineConfig,
    LLMEngine,
    RequestError,
    RequestOutput,
    SamplingParams,
)

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> EngineConfig:
    path = write_demo_checkpoint(tmp_path_factory.mktemp("demo"), "tiny", seed=4)
    return EngineConfig(model=str(path), device="cpu", dtype="float32", kernels="reference",
                        max_num_seqs=8, max_model_len=64, max_num_batched_tokens=16,
                        kv_cache_bytes=4 * 2**20)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(8, 2048, (n,), generator=g).tolist() for n in (3, 11, 20, 33)]


@pytest.fixture
def engine(config):
    eng = AsyncEngine(LLMEngine(config))
    eng.start()
    yield eng
    eng.shutdown()


async def collect(eng: AsyncEngine, rid: str, prompt, params) -> list[RequestOutput]:
    return [out async for out in eng.generate(rid, prompt, params)]


def test_streams_equal_offline_generation(config, engine, prompts) -> None:
    expected = LLMEngine(config).generate(prompts, GREEDY)

    async def main():
        return await asyncio.gather(*(collect(engine, f"r{i}", p, GREEDY)
                                      for i, p in enumerate(prompts)))

    streams = asyncio.run(main())
    for outs, ref in zip(streams, expected):
        assert [t for o in outs for t in o.new_token_ids] == ref.token_ids
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert not any(o.finished for o in outs[:-1])
        assert "".join(o.text_delta for o in outs) == ref.text
        times = [o.time for o in outs]
        assert times == sorted(times) and outs[0].first_token_time == outs[0].time
    stats = engine.stats()
    assert stats.generation_tokens_total >= 40 and stats.num_running == 0


def test_bad_request_raises_before_queuing(engine) -> None:
    async def main():
        with pytest.raises(RequestError, match="maximum context length"):
            await collect(engine, "bad", [5] * 60, GREEDY)
        engine.check_request([5], GREEDY)
        with pytest.raises(RequestError):
            engine.check_request([], GREEDY)

    asyncio.run(main())
    assert engine.stats().requests_added_total == 0


def test_abort_and_closed_iterator_free_the_request(engine, prompts) -> None:
    long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)

    async def aborted():
        outs = []
        async for out in engine.generate("a", prompts[1], long):
            outs.append(out)
            if len(outs) == 2:
                engine.abort("a")
        return outs

    async def closed():
        agen = engine.generate("b", prompts[2], long)
        first = await agen.__anext__()
        await agen.aclose()  # a client that disconnected
        return first

    async def main():
        outs, first = await asyncio.gather(aborted(), closed())
        assert outs[-1].finish_reason == "abort" and len(outs) < 40
        assert first.new_token_ids
        for _ in range(100):  # the abort of "b" reaches the engine thread within a step
            if engine.stats().num_running == 0:
                break
            await asyncio.sleep(0.02)

    asyncio.run(main())
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert stats.requests_finished_total["abort"] == 2
    engine.engine.cache.check_no_leaks(set())


def test_shutdown_ends_open_streams(config, prompts) -> None:
    eng = AsyncEngine(LLMEngine(config))
    eng.start()

    async def main():
        agen = eng.generate("s", prompts[0], SamplingParams(max_tokens=60, temperature=0,
                                                           ignore_eos=True))
        await agen.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, eng.shutdown)
        rest = [o async for o in agen]
        assert rest and rest[-1].finish_reason == "abort"

    asyncio.run(main())
    assert not eng.is_running
