"""Scheduler: decodes first, chunked prefill within the budget, max_num_seqs, queuing when the
cache is full, preemption by recompute that keeps every generated token, aborts."""

from __future__ import annotations

import random

import pytest
import torch

from model.serve.engine.kv_cache import KVLayout, PagedKVCache
from model.serve.engine.scheduler import Scheduler, SchedulerConfig, Sequence, Status


def make(max_seqs: int = 4, budget: int = 16, full_pages: int = 100, swa_pages: int = 100,
         window: int = 8, page: int = 4) -> Scheduler:
    lay = KVLayout((1,), (0,), window, page, 1, 8, torch.float32)
    return Scheduler(SchedulerConfig(max_seqs, budget), PagedKVCache(lay, full_pages, swa_pages))


def run_step(sched: Scheduler, token: int = 1):
    """One step without a model: the cache is advanced and sampling chunks get `token`."""
    out = sched.schedule()
    sched.advance(out)
    for chunk in out.chunks:
        if chunk.sample:
            chunk.seq.output_ids.append(token)
    return out


@pytest.fixture
def rng() -> random.Random:
    return random.Random(7)


@pytest.mark.parametrize("budget", [1, 7, 16])
def test_chunked_prefill_respects_the_budget_and_covers_the_prompt(budget: int) -> None:
    sched = make(budget=budget)
    seq = Sequence("a", list(range(41)))
    sched.add(seq)
    sizes = []
    while not seq.output_ids:
        out = run_step(sched)
        assert out.num_tokens <= budget
        sizes.append(out.num_tokens)
        assert [c.sample for c in out.chunks] == [seq.num_computed == 41]
        assert out.chunks[0].token_ids == list(range(41))[out.chunks[0].start:seq.num_computed]
    assert sum(sizes) == 41 and seq.num_computed == 41


def test_decodes_go_first_then_prefill_chunks_fill_the_budget() -> None:
    sched = make(max_seqs=4, budget=10)
    a = Sequence("a", [1, 2, 3])
    sched.add(a)
    run_step(sched)  # a prefilled, one token out
    b = Sequence("b", list(range(30)))
    sched.add(b)
    out = run_step(sched)
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 9)]
    out = run_step(sched)
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in out.chunks] == [
        ("a", 4, 1), ("b", 9, 9)]


def test_max_num_seqs_queues_the_rest() -> None:
    sched = make(max_seqs=2, budget=100)
    seqs = [Sequence(str(i), [1, 2]) for i in range(5)]
    for s in seqs:
        sched.add(s)
    out = run_step(sched)
    assert len(out.chunks) == 2 and len(sched.waiting) == 3
    sched.finish(seqs[0])
    out = run_step(sched)
    assert {c.seq.request_id for c in out.chunks} == {"1", "2"}


def test_admission_waits_for_pages_instead_of_failing() -> None:
    sched = make(max_seqs=8, budget=64, full_pages=1 + 6)  # 24 tokens of full context
    a, b = Sequence("a", list(range(20))), Sequence("b", list(range(10)))
    sched.add(a)
    sched.add(b)
    out = run_step(sched)
    assert [c.seq.request_id for c in out.chunks] == ["a"] and b.status == Status.WAITING
    sched.finish(a)
    out = run_step(sched)
    assert [c.seq.request_id for c in out.chunks] == ["b"]
    sched.cache.check_no_leaks({b.seq_id})


def test_preemption_recomputes_and_keeps_generated_tokens() -> None:
    sched = make(max_seqs=4, budget=64, full_pages=1 + 5)  # 20 tokens of full context
    a, b = Sequence("a", list(range(8))), Sequence("b", list(range(8)))
    sched.add(a)
    sched.add(b)
    run_step(sched, token=100)
    for t in range(101, 104):  # 8 + 4 tokens each: 3 pages each, 6 > 5 usable
        out = run_step(sched, token=t)
    assert sched.num_preemptions >= 1
    assert b.status == Status.WAITING and b.num_computed == 0
    assert b.output_ids and b.output_ids[0] == 100  # generated tokens survive preemption
    kept = list(b.output_ids)
    sched.finish(a)
    out = run_step(sched, token=200)
    (chunk,) = out.chunks
    assert chunk.seq is b and chunk.start == 0 and chunk.num_tokens == 8 + len(kept)
    assert chunk.token_ids == list(range(8)) + kept and chunk.sample
    assert b.output_ids == kept + [200]


def test_abort_anywhere_frees_pages() -> None:
    sched = make(max_seqs=1)
    a, b = Sequence("a", [1, 2, 3]), Sequence("b", [4])
    sched.add(a)
    sched.add(b)
    run_step(sched)
    assert sched.find("b") is b and b.status == Status.WAITING
    sched.finish(b)
    sched.finish(a)
    assert not sched.has_unfinished()
    sched.cache.check_no_leaks(set())


def test_random_load_never_loses_a_request(rng: random.Random) -> None:
    sched = make(max_seqs=5, budget=13, full_pages=1 + 12, swa_pages=1 + 20)
    pending = [Sequence(str(i), list(range(rng.randint(1, 30)))) for i in range(300)]
    goal = {s.request_id: rng.randint(1, 12) for s in pending}
    done = []
    for _ in range(20000):
        while pending and rng.random() < 0.3:
            sched.add(pending.pop())
        out = sched.schedule()
        sched.advance(out)
        for chunk in out.chunks:
            if chunk.sample:
                seq = chunk.seq
                seq.output_ids.append(len(seq.output_ids))
                if len(seq.output_ids) == goal[seq.request_id]:
                    sched.finish(seq)
                    done.append(seq)
        if not pending and not sched.has_unfinished():
            break
        live = {s.seq_id for s in sched.running}
        sched.cache.check_no_leaks(live)
    assert len(done) == 300 and sched.num_preemptions > 0
    assert all(s.output_ids == list(range(goal[s.request_id])) for s in done)
    sched.cache.check_no_leaks(set())
