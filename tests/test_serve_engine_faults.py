"""engine/faults.py and LLMEngine.step: a request's failure stays its own; shared ones stop it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from model.demo import write_demo_checkpoint
from model.serve.engine import EngineConfig, LLMEngine, RequestError, SamplingParams
from model.serve.engine.faults import (
    MAX_STEPS_FAILING_EVERY_REQUEST,
    EngineFatalError,
    StepIsolation,
    is_device_fault,
)
from tests.api_support import torch_threads

VOCAB = 11


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


@dataclass
class Chunk:
    seq_id: int
    sample: bool = True


class FakeRunner:
    """Logits row i is full of seq_id; chunks whose seq_id is in `bad` make execute raise."""

    def __init__(self, bad=(), error=RuntimeError("bad input")) -> None:
        self.bad, self.error, self.calls = set(bad), error, []
        self.model = SimpleNamespace(shard=SimpleNamespace(vocab_size=VOCAB))
        self.device = torch.device("cpu")

    def execute(self, chunks):
        self.calls.append([c.seq_id for c in chunks])
        if any(c.seq_id in self.bad for c in chunks):
            raise self.error
        return torch.tensor([[float(c.seq_id)] * VOCAB for c in chunks if c.sample])


def test_a_failing_chunk_is_found_and_the_others_run() -> None:
    runner = FakeRunner(bad={2})
    chunks = [Chunk(1), Chunk(2), Chunk(3, sample=False), Chunk(4)]
    logits, failed = StepIsolation().execute(runner, chunks)
    assert list(failed) == [1] and str(failed[1]) == "bad input"
    assert logits[:, 0].tolist() == [1.0, 4.0]  # the sampling chunks that ran, in order
    assert runner.calls == [[1, 2, 3, 4], [1], [2], [3], [4]]


def test_a_step_that_fails_for_everyone_several_times_is_fatal() -> None:
    iso = StepIsolation()
    for _ in range(MAX_STEPS_FAILING_EVERY_REQUEST - 1):
        _, failed = iso.execute(FakeRunner(bad={1, 2}), [Chunk(1), Chunk(2)])
        assert len(failed) == 2
    iso.execute(FakeRunner(bad={1}), [Chunk(1), Chunk(5)])  # one success resets the count
    for _ in range(MAX_STEPS_FAILING_EVERY_REQUEST - 1):
        iso.execute(FakeRunner(bad={1}), [Chunk(1)])
    with pytest.raises(EngineFatalError, match="every request"):
        iso.execute(FakeRunner(bad={1}), [Chunk(1)])


@pytest.mark.parametrize("error", [RuntimeError("CUDA error: an illegal memory access"),
                                   RuntimeError("device-side assert triggered")])
def test_device_faults_are_fatal_at_once(error) -> None:
    assert is_device_fault(error)
    with pytest.raises(EngineFatalError):
        StepIsolation().execute(FakeRunner(bad={1}, error=error), [Chunk(1), Chunk(2)])
    assert not is_device_fault(RuntimeError("shape mismatch"))


def test_without_isolation_a_step_failure_is_fatal() -> None:
    with pytest.raises(EngineFatalError):
        StepIsolation(enabled=False).execute(FakeRunner(bad={1}), [Chunk(1), Chunk(2)])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo"), "tiny", seed=0)


def engine(ckpt: Path) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(ckpt), device="cpu", dtype="float32",
                                  kernels="reference", max_model_len=64, max_num_seqs=4))


PROMPTS = [[9, 10, 11], [12, 13, 14, 15], [16, 17]]
PARAMS = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, seed=s)
          for s in (1, 666, 3)]


@pytest.mark.parametrize("stage", ["sampling", "step", "detokenizing"])
def test_the_engine_fails_one_request_and_serves_the_rest(ckpt, stage, monkeypatch) -> None:
    want = engine(ckpt).generate(PROMPTS, PARAMS)
    eng = engine(ckpt)
    if stage == "sampling":
        real = eng.sampler
        monkeypatch.setattr(eng, "sampler", lambda lg, rows: real(lg, rows) if all(
            r.params.seed != 666 for r in rows) else 1 / 0)
    elif stage == "step":
        real_execute = eng.runner.execute

        def execute(chunks):
            bad = {s.seq_id for s in eng._requests.values() if s.state.params.seed == 666}
            if any(c.seq_id in bad for c in chunks):
                raise ValueError("step fault")
            return real_execute(chunks)

        monkeypatch.setattr(eng.runner, "execute", execute)
    else:
        from model.serve.engine.outputs import RequestState

        real_add = RequestState.add_token
        monkeypatch.setattr(RequestState, "add_token", lambda self, *a: real_add(self, *a)
                            if self.params.seed != 666 else b"\xff".decode())
    got = eng.generate(PROMPTS, PARAMS)
    assert got[1].finish_reason == "error"
    for i in (0, 2):
        assert got[i].token_ids == want[i].token_ids and got[i].finish_reason == "length"
    assert eng.stats().requests_finished_total["error"] == 1
    eng.cache.check_no_leaks(set())


def test_a_request_that_cannot_start_is_refused_cleanly(ckpt) -> None:
    eng = engine(ckpt)
    with pytest.raises(RequestError, match="top_k"):
        eng.add_request("r", [9, 10], SamplingParams(top_k=10**6))
    assert not eng.has_unfinished()
