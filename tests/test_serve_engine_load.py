"""1,000 mixed requests through the real engine, scheduler, KV cache and sampler, with a fake
model runner (for speed) that checks the paging: each step it writes the token ids themselves
into the cache's slots and reads every sampled sequence's keys back, so any two sequences
sharing a slot, a page freed too early or a recompute at the wrong place shows up as a wrong
token. Ends with no page leaked."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from model.beam import BeamForCausalLM
from model.config import preset
from model.serve.engine import EngineConfig, LLMEngine, SamplingParams
from model.serve.engine.kv_cache import FULL, SWA, KVLayout

VOCAB = 2048


def next_token(tokens: list[int]) -> int:
    return (sum(tokens[-3:]) * 7 + len(tokens)) % VOCAB


class PagingCheckRunner:
    """Stands in for ModelRunner: 'KV' is the token id; logits pick next_token(sequence)."""

    def __init__(self, cache) -> None:
        self.cache = cache
        self.store = {g: {} for g in (FULL, SWA)}
        self.window = cache.layout.window

    def execute(self, chunks) -> torch.Tensor:
        written = set()
        for c in chunks:
            stop = c.start + c.num_tokens
            assert self.cache.length(c.seq_id) == stop
            for group in (FULL, SWA):
                for slot, tok in zip(self.cache.slots(c.seq_id, group, c.start, stop),
                                     c.token_ids):
                    assert (group, slot) not in written, "two tokens of a step share a slot"
                    written.add((group, slot))
                    self.store[group][slot] = tok
        rows = []
        for c in chunks:
            if not c.sample:
                continue
            stop = c.start + c.num_tokens
            full = [self.store[FULL][s] for s in self.cache.slots(c.seq_id, FULL, 0, stop)]
            lo = max(0, stop - self.window)
            swa = [self.store[SWA][s] for s in self.cache.slots(c.seq_id, SWA, lo, stop)]
            assert swa == full[lo:]  # the window pages hold the same recent tokens
            logits = torch.zeros(VOCAB)
            logits[next_token(full)] = 1.0
            rows.append(logits)
        return torch.stack(rows) if rows else torch.empty(0, VOCAB)


@pytest.fixture
def rng() -> random.Random:
    return random.Random(2024)


def test_thousand_mixed_requests_leak_nothing(rng: random.Random) -> None:
    cfg = preset("tiny")
    model = BeamForCausalLM(cfg, dtype=torch.float32)  # never run: the fake runner answers
    config = EngineConfig(device="cpu", dtype="float32", max_num_seqs=16, max_model_len=96,
                          max_num_batched_tokens=37, page_size=4, kv_cache_bytes=1)
    # The budget: the window reserve plus 108 pages (432 tokens, 4.5 full contexts) of full KV.
    lay = KVLayout.for_model(cfg, model.shard, 4, torch.float32)
    budget = (lay.swa_reserve(16, 37, 96) * lay.page_bytes(SWA)
              + (1 + 108) * lay.page_bytes(FULL))
    eng = LLMEngine(replace(config, kv_cache_bytes=budget), model=model)
    eng.runner = PagingCheckRunner(eng.cache)
    todo = []
    for i in range(1000):
        prompt = [rng.randrange(8, VOCAB) for _ in range(rng.randint(1, 60))]
        todo.append((f"r{i}", prompt, rng.randint(1, 30)))
    expected = {}
    for rid, prompt, n in todo:
        seq = list(prompt)
        for _ in range(n):
            seq.append(next_token(seq))
        expected[rid] = seq[len(prompt):]
    finals, aborted = {}, set()
    pending = list(reversed(todo))
    while pending or eng.has_unfinished():
        for _ in range(rng.randint(0, 4)):
            if pending:
                rid, prompt, n = pending.pop()
                eng.add_request(rid, prompt, SamplingParams(max_tokens=n, temperature=0,
                                                            ignore_eos=True))
        if rng.random() < 0.03 and eng.scheduler.running:
            victim = rng.choice(eng.scheduler.running + list(eng.scheduler.waiting))
            assert eng.abort(victim.request_id)
            aborted.add(victim.request_id)
        for out in eng.step():
            if out.finished:
                assert out.request_id not in finals
                finals[out.request_id] = out
        live = {s.seq_id for s in eng.scheduler.running}
        eng.cache.check_no_leaks(live)
    assert len(finals) == 1000
    assert eng.stats().num_preemptions > 10  # the cache was tight: recompute happened
    for rid, out in finals.items():
        if rid in aborted:
            assert out.finish_reason == "abort"
            assert out.token_ids == expected[rid][: len(out.token_ids)]
        else:
            assert out.finish_reason == "length" and out.token_ids == expected[rid]
    eng.cache.check_no_leaks(set())
    assert eng.cache.usage() == 0.0
    stats = eng.stats()
    assert stats.requests_added_total == 1000
    assert sum(stats.requests_finished_total.values()) == 1000
