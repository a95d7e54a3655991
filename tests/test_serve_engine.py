"""Engine end to end on CPU in FP32: greedy generation equals transformers' `generate` token for
token (prompts shorter and longer than the sliding window, batched at different lengths, chunked
prefill at odd sizes, batched decode attention, preemption), and the engine's request handling."""

from __future__ import annotations

import pytest
import torch

from model.config import preset
from model.demo import write_demo_checkpoint
from model.serve.engine import EngineConfig, LLMEngine, RequestError, SamplingParams
from model.serve.engine.kv_cache import FULL, SWA
from tests._hf import save_hf_checkpoint

NEW = 12  # tokens generated per prompt
# Shorter and longer than the windows (16 for the demo, 5 for the HF-written one), and odd.
PROMPT_LENS = (1, 4, 5, 16, 17, 40)
# Written by transformers' save_pretrained: 7 layers (full attention at 5 and 6), window 5.
HF_CONFIG = preset("tiny").replace(num_hidden_layers=7, sliding_window=5)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    return {"demo": write_demo_checkpoint(tmp_path_factory.mktemp("demo"), "tiny", seed=3),
            "hf": save_hf_checkpoint(HF_CONFIG, tmp_path_factory.mktemp("hf"), seed=5)}


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(8, 2048, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def reference(checkpoints, prompts) -> dict:
    """transformers' greedy continuation of every prompt, per checkpoint (FP32, eager attention,
    grouped_mm experts: the pinned reference of docs/numerics.md)."""
    from transformers import AutoModelForCausalLM

    out = {}
    for name, path in checkpoints.items():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                  attn_implementation="eager",
                                                  experts_implementation="grouped_mm")
        hf.generation_config.eos_token_id = None  # the engine runs with ignore_eos
        for i, p in enumerate(prompts):
            ids = hf.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False,
                              pad_token_id=7)
            out[name, i] = ids[0, len(p):].tolist()
    return out


def engine(path, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_bytes", 8 * 2**20)
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("max_model_len", 128)
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", kernels="reference",
                                  device="cpu", **kw))


GREEDY = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("ckpt", ["demo", "hf"])
@pytest.mark.parametrize("batched_tokens,page", [(2048, 16), (7, 4), (13, 5)])
def test_greedy_batch_equals_transformers(checkpoints, prompts, reference, ckpt, batched_tokens,
                                          page) -> None:
    eng = engine(checkpoints[ckpt], max_num_batched_tokens=batched_tokens, page_size=page)
    results = eng.generate(prompts, GREEDY)
    for i, r in enumerate(results):
        assert r.token_ids == reference[ckpt, i], f"prompt of {len(prompts[i])} tokens"
        assert r.finish_reason == "length"
    eng.cache.check_no_leaks(set())


@pytest.mark.parametrize("ckpt", ["demo", "hf"])
def test_batched_decode_attention_equals_transformers(checkpoints, prompts, reference,
                                                      ckpt) -> None:
    eng = engine(checkpoints[ckpt], max_num_batched_tokens=9, page_size=4)
    eng.runner.batched_decode = True  # the GPU's path, on the CPU
    for i, r in enumerate(eng.generate(prompts, GREEDY)):
        assert r.token_ids == reference[ckpt, i]


def test_preemption_loses_nothing(checkpoints, prompts, reference) -> None:
    # A cache of 4 + 60 tokens of full context for 6 requests of up to 52 tokens: requests
    # queue, and running ones get preempted and recomputed.
    probe = engine(checkpoints["demo"], page_size=4, max_num_seqs=4, max_num_batched_tokens=11)
    lay = probe.cache.layout
    swa = lay.swa_reserve(4, 11, 64)
    budget = swa * lay.page_bytes(SWA) + (1 + 16) * lay.page_bytes(FULL)
    eng = engine(checkpoints["demo"], page_size=4, max_num_seqs=4, max_num_batched_tokens=11,
                 max_model_len=64, kv_cache_bytes=budget)
    assert eng.cache.capacity_tokens == 64
    results = eng.generate(prompts, GREEDY)
    assert eng.stats().num_preemptions > 0
    for i, r in enumerate(results):
        assert r.token_ids == reference["demo", i]
    eng.cache.check_no_leaks(set())


def test_window_pages_stay_bounded_while_serving(checkpoints, prompts) -> None:
    eng = engine(checkpoints["demo"], page_size=4, max_num_batched_tokens=5)
    bound = eng.cache.layout.swa_pages_between_steps
    for i, p in enumerate(prompts[3:]):
        eng.add_request(str(i), p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    peak = 0
    while eng.has_unfinished():
        eng.step()
        for seq in eng.scheduler.running:
            full, swa = eng.cache.num_pages_held(seq.seq_id)
            assert swa <= bound
            assert full == -(-seq.num_computed // 4)
            peak = max(peak, seq.num_computed)
    assert peak > 4 * 16  # sequences grew well past the window
    eng.cache.check_no_leaks(set())


def test_seeded_sampling_does_not_depend_on_the_batch(checkpoints, prompts) -> None:
    eng = engine(checkpoints["demo"])
    p = SamplingParams(max_tokens=10, temperature=1.5, top_k=50, seed=123, ignore_eos=True)
    alone = eng.generate([prompts[3]], p)[0].token_ids
    others = SamplingParams(max_tokens=7, temperature=1.0, ignore_eos=True)
    batch = eng.generate(prompts, [others, others, others, p, others, others])
    assert batch[3].token_ids == alone
    assert eng.generate([prompts[3]], p)[0].token_ids == alone


def test_stop_token_ids_and_stop_strings(checkpoints, prompts) -> None:
    eng = engine(checkpoints["demo"])
    free = eng.generate([prompts[4]], GREEDY)[0]
    stop_id = free.token_ids[5]
    first = free.token_ids.index(stop_id)
    r = eng.generate([prompts[4]], SamplingParams(max_tokens=NEW, temperature=0,
                                                  stop_token_ids=[stop_id]))[0]
    assert r.finish_reason == "stop" and r.stop_reason == stop_id
    assert r.token_ids == free.token_ids[: first + 1]
    text = eng.tokenizer.decode(free.token_ids)
    assert len(text) > 8
    stop = text[4:7]
    r = eng.generate([prompts[4]], SamplingParams(max_tokens=NEW, temperature=0, stop=[stop],
                                                  ignore_eos=True))[0]
    assert r.finish_reason == "stop" and r.stop_reason == stop
    assert r.text == text[: text.index(stop)]


def test_streamed_text_deltas_add_up(checkpoints, prompts) -> None:
    eng = engine(checkpoints["demo"])
    eng.add_request("a", prompts[5], SamplingParams(max_tokens=NEW, temperature=0,
                                                    ignore_eos=True, logprobs=2))
    deltas, last = [], None
    while eng.has_unfinished():
        for out in eng.step():
            deltas.append(out.text_delta)
            assert len(out.logprobs) == len(out.new_token_ids) == 1
            last = out
    assert "".join(deltas) == last.text == eng.tokenizer.decode(last.token_ids)
    assert last.completion_tokens == NEW and last.prompt_tokens == len(prompts[5])


def test_logprobs_match_transformers(checkpoints, prompts) -> None:
    from transformers import AutoModelForCausalLM

    eng = engine(checkpoints["demo"])
    r = eng.generate([prompts[2]], SamplingParams(max_tokens=4, temperature=0, logprobs=3,
                                                  ignore_eos=True))[0]
    hf = AutoModelForCausalLM.from_pretrained(checkpoints["demo"], dtype=torch.float32,
                                              attn_implementation="eager",
                                              experts_implementation="grouped_mm")
    ids = torch.tensor([prompts[2] + r.token_ids])
    ref = torch.log_softmax(hf(ids).logits[0, len(prompts[2]) - 1: -1].float(), dim=-1)
    for lp, row in zip(r.logprobs, ref):
        # FP32 end to end; paged vs. unpaged attention differ only in reduction order.
        assert lp.logprob == pytest.approx(row[lp.token_id].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()


def test_bad_requests_raise_before_queuing(checkpoints) -> None:
    eng = engine(checkpoints["demo"], max_model_len=32)
    ok = SamplingParams(max_tokens=4)
    for prompt, params, match in [
        ([], ok, "empty"),
        ([1] * 30, ok, "maximum context length is 32"),
        ([5, 2048], ok, "outside the vocabulary"),
        ([5, -1], ok, "outside the vocabulary"),
        ([5], SamplingParams(stop_token_ids=[99999]), "stop token id"),
        ([5], {"max_tokens": 3}, "SamplingParams"),
    ]:
        with pytest.raises(RequestError, match=match):
            eng.add_request("x", prompt, params)
    assert not eng.has_unfinished()
    eng.add_request("x", [5], ok)
    with pytest.raises(RequestError, match="already running"):
        eng.add_request("x", [6], ok)


def test_abort_frees_everything_and_reports(checkpoints, prompts) -> None:
    eng = engine(checkpoints["demo"], max_num_batched_tokens=5)
    for i in range(3):
        eng.add_request(str(i), prompts[5], GREEDY)
    eng.step()
    assert eng.abort("1") and not eng.abort("nope")
    outs = eng.step()
    final = [o for o in outs if o.request_id == "1"]
    assert len(final) == 1 and final[0].finished and final[0].finish_reason == "abort"
    while eng.has_unfinished():
        eng.step()
    eng.cache.check_no_leaks(set())
    stats = eng.stats()
    assert stats.requests_finished_total == {"stop": 0, "length": 2, "abort": 1, "error": 0}
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_usage == 0.0
