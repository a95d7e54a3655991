"""Batch-invariant mode (EngineConfig.batch_invariant, `autoopt serve --batch-invariant`), BF16 on
the CPU: a request's greedy tokens and their logprobs are bitwise the same alone, batched with
chunked prefill, after preemption, and when its generated tokens come back as a prompt."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from model.demo import write_demo_checkpoint
from model.serve.engine import EngineConfig, LLMEngine, SamplingParams
from model.serve.engine.kv_cache import FULL, SWA
from tests.api_support import torch_threads

G = 8
GREEDY = SamplingParams(max_tokens=G, temperature=0, ignore_eos=True, logprobs=0)
BASE = {"device": "cpu", "dtype": "bfloat16", "kernels": "reference", "page_size": 4,
        "max_model_len": 96, "max_num_seqs": 4}


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo"), "tiny", seed=0)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(10, 2000, (n,), generator=g).tolist() for n in (48, 37, 55, 29)]


def engine(ckpt: Path, invariant: bool, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(ckpt), batch_invariant=invariant, **{**BASE, **kw}))


def trace(result) -> list[tuple[int, float]]:
    """(token, its logprob): logprobs equal bitwise only if the logits were."""
    return [(t, lp.logprob) for t, lp in zip(result.token_ids, result.logprobs)]


def preempting(ckpt: Path, invariant: bool) -> LLMEngine:
    """Room for 2 sequences' worth of full-attention pages: the 4 requests preempt each other."""
    probe = engine(ckpt, invariant, max_num_batched_tokens=16)
    lay = probe.cache.layout
    budget = (lay.swa_reserve(4, 16, 96) * lay.page_bytes(SWA)
              + (1 + 2 * 64 // 4) * lay.page_bytes(FULL))
    return engine(ckpt, invariant, max_num_batched_tokens=16, kv_cache_bytes=budget)


@pytest.mark.slow
def test_greedy_tokens_do_not_depend_on_the_batch(ckpt, prompts):
    alone_eng = engine(ckpt, True)
    alone = [trace(alone_eng.generate([p], GREEDY)[0]) for p in prompts]
    batched = engine(ckpt, True, max_num_batched_tokens=16).generate(prompts, GREEDY)
    assert [trace(r) for r in batched] == alone
    eng = preempting(ckpt, True)
    preempted = eng.generate(prompts, GREEDY)
    assert eng.stats().num_preemptions > 0
    assert [trace(r) for r in preempted] == alone
    eng.cache.check_no_leaks(set())


@pytest.mark.gpu
def test_greedy_tokens_do_not_depend_on_the_batch_on_the_gpu(ckpt, prompts):
    """The same on CUDA, with CUDA-graph decode and the GPU's attention backend."""
    # A fixed cache (64 MiB): a share of the free memory depends on what earlier tests hold.
    gpu = {"device": "cuda", "cuda_graphs": True, "attention_backend": "auto",
           "kv_cache_bytes": 64 << 20}
    alone_eng = engine(ckpt, True, **gpu)
    alone = [trace(alone_eng.generate([p], GREEDY)[0]) for p in prompts]
    batched = engine(ckpt, True, max_num_batched_tokens=16, **gpu).generate(prompts, GREEDY)
    assert [trace(r) for r in batched] == alone
    recomputed = [pair for p in prompts for pair in prefill_vs_decode(ckpt, p, True, **gpu)]
    assert all(decoded == prefilled for decoded, prefilled in recomputed)


def prefill_vs_decode(ckpt: Path, prompt: list[int], invariant: bool, **kw) -> list[tuple]:
    """Pairs (decoded, prefilled) for each generated token: the token's logprob when decoded,
    and when the prompt plus the tokens before it are prefilled in one chunk (a recompute)."""
    eng = engine(ckpt, invariant, **kw)
    first = eng.generate([prompt], GREEDY)[0]
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=0)
    again = eng.generate([prompt + first.token_ids[:k] for k in range(1, G)], one)
    return [(trace(first)[k], trace(r)[0]) for k, r in zip(range(1, G), again)]


def test_a_recomputed_token_equals_the_decoded_one(ckpt, prompts):
    for decoded, prefilled in prefill_vs_decode(ckpt, prompts[0], invariant=True):
        assert decoded == prefilled


def _row_count_dependent_gemms() -> bool:
    """Whether this CPU's BF16 GEMMs at the tiny model's widths give a row a different result
    alone than among 48 rows (oneDNN's AMX kernels do; many CPUs do not)."""
    from model.config import preset

    cfg = preset("tiny")
    g = torch.Generator().manual_seed(0)
    with torch_threads(1):
        for out in (cfg.vocab_size, cfg.intermediate_size, cfg.hidden_size):
            w = torch.randn(out, cfg.hidden_size, generator=g).bfloat16()
            x = torch.randn(48, cfg.hidden_size, generator=g).bfloat16()
            if not torch.equal(torch.nn.functional.linear(x[:1], w),
                               torch.nn.functional.linear(x, w)[:1]):
                return True
    return False


@pytest.mark.skipif(not _row_count_dependent_gemms(),
                    reason="this CPU's BF16 GEMMs give a row the same result at any row count, "
                    "so the default mode is invariant here too")
def test_the_default_mode_is_not_invariant_here(ckpt, prompts):
    """Why the mode exists: without it the same token's logprob differs between a decode and
    a prefill of the same context (BF16 GEMMs over 1 row vs ~50 rows)."""
    pairs = prefill_vs_decode(ckpt, prompts[0], invariant=False)
    assert any(decoded[1] != prefilled[1] for decoded, prefilled in pairs)


def test_serve_flag_reaches_the_engine(monkeypatch, tmp_path):
    import model.serve.http.server as server
    from autoopt.cli import app

    seen = []
    monkeypatch.setattr(server, "run_server", lambda opts, say: seen.append(opts))
    result = CliRunner().invoke(app, ["serve", "--batch-invariant"])
    assert result.exit_code == 0, result.output
    assert server.engine_config(seen[0], tmp_path).batch_invariant is True
    CliRunner().invoke(app, ["serve"])
    assert server.engine_config(seen[1], tmp_path).batch_invariant is False


@pytest.mark.slow
def test_the_gpu_benchmark_dry_run(tmp_path):
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "batch_invariant_bench.py"
    spec = importlib.util.spec_from_file_location("batch_invariant_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--dry-run", "--concurrency", "2", "--check-prompts", "2",
                         "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "batch_invariant.json").read_text())
    assert [m["batch_invariant"] for m in saved["modes"]] == [False, True]
    invariant = saved["modes"][1]["invariance"]
    assert invariant["batched_logprobs_differ"] == invariant["recomputed_differ"] == 0
    assert all(m["rows"][0]["generated_tokens"] == 8 for m in result["modes"])
    assert "| batch-invariant | 2 |" in (tmp_path / "batch_invariant.md").read_text()
