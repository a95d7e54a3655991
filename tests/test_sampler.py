"""Sampler: filters against a direct per-row computation, seeds, greedy, logprobs, stop checks."""

from __future__ import annotations

import math

import pytest
import torch

from model.serve.engine.sampler import (
    RequestError,
    Sampler,
    SampleRequest,
    SamplingParams,
    apply_filters,
    find_stop,
    make_generator,
    partial_stop_suffix,
    sample_isolated,
)

VOCAB = 123


@pytest.fixture
def logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(5, VOCAB, generator=g) * 3


def kept_direct(row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> set[int]:
    """The tokens each filter keeps, one after the other, by plain loops (transformers' order)."""
    keep = set(range(row.numel()))
    if top_k > 0:
        kth = sorted(row.tolist(), reverse=True)[min(top_k, row.numel()) - 1]
        keep = {i for i in keep if row[i] >= kth}
    if top_p < 1:
        probs = torch.softmax(torch.tensor([row[i].item() if i in keep else -math.inf
                                            for i in range(row.numel())]), 0).tolist()
        mass, kept = 0.0, set()
        for i in sorted(keep, key=lambda i: -probs[i]):
            if mass >= top_p:
                break
            kept.add(i)
            mass += probs[i]
        keep = kept
    if min_p > 0:
        probs = torch.softmax(torch.tensor([row[i].item() if i in keep else -math.inf
                                            for i in range(row.numel())]), 0)
        keep = {i for i in keep if probs[i] >= min_p * probs.max()}
    return keep


@pytest.mark.parametrize("top_k,top_p,min_p", [
    (0, 1.0, 0.0), (1, 1.0, 0.0), (17, 1.0, 0.0), (0, 0.5, 0.0), (0, 0.9, 0.0),
    (0, 1.0, 0.1), (40, 0.8, 0.05), (VOCAB + 5, 0.3, 0.0), (0, 1e-6, 0.0), (3, 1.0, 0.99)])
def test_filters_match_a_direct_computation(logits, top_k, top_p, min_p) -> None:
    n = logits.shape[0]
    out = apply_filters(logits, torch.full((n,), top_k), torch.full((n,), top_p),
                        torch.full((n,), min_p))
    for r in range(n):
        kept = {i for i in range(VOCAB) if out[r, i] > -math.inf}
        assert kept == kept_direct(logits[r], top_k, top_p, min_p)
        assert torch.equal(out[r][out[r] > -math.inf], logits[r][out[r] > -math.inf])


def test_filters_take_per_row_parameters(logits) -> None:
    params = [(0, 1.0, 0.0), (5, 1.0, 0.0), (0, 0.7, 0.0), (0, 1.0, 0.2), (9, 0.6, 0.01)]
    out = apply_filters(logits, torch.tensor([p[0] for p in params]),
                        torch.tensor([p[1] for p in params]), torch.tensor([p[2] for p in params]))
    for r, p in enumerate(params):
        assert {i for i in range(VOCAB) if out[r, i] > -math.inf} == kept_direct(logits[r], *p)


def test_greedy_is_argmax_and_ignores_generators(logits) -> None:
    rows = [SampleRequest(SamplingParams(temperature=0), None) for _ in range(5)]
    tokens, lps = Sampler()(logits, rows)
    assert tokens == logits.argmax(-1).tolist() and lps == [None] * 5


def test_a_seed_gives_the_same_tokens_whatever_the_batch(logits) -> None:
    p = SamplingParams(temperature=3.0, top_p=0.9, seed=42)

    def draw(batch_rows: list[int], steps: int = 20) -> list[int]:
        gens = {r: make_generator(1000 + r, logits.device) for r in batch_rows}
        gens[2] = make_generator(42, logits.device)
        out = []
        for _ in range(steps):
            rows = [SampleRequest(p if r == 2 else SamplingParams(temperature=1.3), gens[r])
                    for r in batch_rows]
            tokens, _ = Sampler()(logits[batch_rows], rows)
            out.append(tokens[batch_rows.index(2)])
        return out

    alone = draw([2])
    assert draw([0, 2, 4]) == alone and draw([4, 3, 2, 1]) == alone
    assert len(set(alone)) > 1  # it does sample


def test_sampling_stays_inside_the_filtered_set(logits) -> None:
    p = SamplingParams(temperature=1.0, top_k=3)
    gen = make_generator(0, logits.device)
    top3 = set(logits[0].topk(3).indices.tolist())
    seen = {Sampler()(logits[:1], [SampleRequest(p, gen)])[0][0] for _ in range(200)}
    assert seen <= top3 and len(seen) == 3


def test_logprobs_are_the_model_distribution(logits) -> None:
    rows = [SampleRequest(SamplingParams(temperature=0, logprobs=n), None) for n in (0, 3, 20)]
    rows += [SampleRequest(SamplingParams(temperature=0), None)] * 2
    tokens, lps = Sampler()(logits, rows)
    ref = torch.log_softmax(logits, dim=-1)
    for r, n in enumerate((0, 3, 20)):
        assert lps[r].token_id == tokens[r]
        assert lps[r].logprob == pytest.approx(ref[r, tokens[r]].item(), abs=1e-6)
        assert [t for t, _ in lps[r].top] == ref[r].topk(n).indices.tolist() if n else True
        assert len(lps[r].top) == n
    assert lps[3] is None and lps[4] is None


@pytest.mark.parametrize("bad", [
    {"max_tokens": 0}, {"max_tokens": -3}, {"temperature": -0.1}, {"top_p": 0.0},
    {"top_p": 1.5}, {"top_k": -2}, {"min_p": 1.2}, {"logprobs": 21}, {"stop": [""]},
    {"temperature": math.nan}, {"temperature": math.inf}, {"top_p": math.nan},
    {"min_p": math.nan}, {"seed": 2**64}, {"seed": 2**63}, {"seed": -(2**63) - 1},
    {"seed": 1.5}, {"top_k": 2.0}, {"max_tokens": True}, {"stop_token_ids": [1.5]}])
def test_bad_parameters_raise_request_error(bad) -> None:
    with pytest.raises(RequestError):
        SamplingParams(**bad)
    assert issubclass(RequestError, ValueError)


@pytest.mark.parametrize("given,used", [
    (1e-45, 0.0), (9.99e-6, 0.0), (1e-5, 0.01), (5e-3, 0.01), (0.01, 0.01), (0.7, 0.7)])
def test_tiny_temperatures_are_greedy_or_raised_to_the_floor(given, used) -> None:
    p = SamplingParams(temperature=given)
    assert p.temperature == used and p.greedy == (used == 0)


def test_extreme_valid_parameters_sample_finite_tokens(logits) -> None:
    """The values that once stopped the engine: int64's ends as seeds, the smallest positive
    temperature, top_k at the vocabulary."""
    rows = [SampleRequest(p, make_generator(p.seed, torch.device("cpu"))) for p in (
        SamplingParams(temperature=1e-45, seed=-(2**63)),
        SamplingParams(temperature=5e-3, seed=2**63 - 1),
        SamplingParams(temperature=1.0, top_k=VOCAB, seed=0),
        SamplingParams(temperature=100.0, top_p=1e-9, seed=1),
        SamplingParams(temperature=2.0, min_p=1.0, seed=2))]
    tokens, _ = Sampler()(logits, rows)
    assert all(0 <= t < VOCAB for t in tokens)
    assert tokens[0] == int(logits[0].argmax())  # 1e-45 is greedy


def test_a_failing_row_is_pinned_on_its_request(logits) -> None:
    rows = [SampleRequest(SamplingParams(temperature=0), None) for _ in range(5)]
    sampler = Sampler()

    def flaky(lg, rs):
        if any(r is rows[2] for r in rs):
            raise RuntimeError("row 2 cannot be sampled")
        return sampler(lg, rs)

    tokens, lps, errors = sample_isolated(flaky, logits, rows)
    assert [e is not None for e in errors] == [False, False, True, False, False]
    assert tokens[2] is None and tokens[:2] + tokens[3:] == \
        logits[[0, 1, 3, 4]].argmax(-1).tolist()
    tokens, _, errors = sample_isolated(sampler, logits, rows)
    assert errors == [None] * 5 and tokens == logits.argmax(-1).tolist()


def test_params_normalize_stop_lists() -> None:
    p = SamplingParams(stop="###", stop_token_ids=[5, 6])
    assert p.stop == ("###",) and p.stop_token_ids == (5, 6)


@pytest.mark.parametrize("text,stops,start,expected", [
    ("hello world", ["wor"], 0, (6, "wor")),
    ("hello world", ["wor", "lo"], 0, (3, "lo")),
    ("hello world", ["o w"], 6, (4, "o w")),  # its last character is new: found
    ("hello world", ["o w"], 7, None),  # wholly in the old text: seen before
    ("hello world", ["hel"], 9, None),  # ended before the new text
    ("abc", ["x"], 0, None),
])
def test_find_stop(text, stops, start, expected) -> None:
    assert find_stop(text, stops, start) == expected


@pytest.mark.parametrize("text,stops,expected", [
    ("hello wo", ["world"], 2), ("hello", ["world"], 0), ("abcab", ["abcabd"], 5),
    ("xx<|en", ["<|end|>", "<|return|>"], 4), ("", ["a"], 0)])
def test_partial_stop_suffix(text, stops, expected) -> None:
    assert partial_stop_suffix(text, stops) == expected
