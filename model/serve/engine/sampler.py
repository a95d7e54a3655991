"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, min-p, per-request
seeds, logprobs; and the stop checks (stop token ids, stop strings, max_tokens).

Filters apply in transformers' order: temperature, then top-k, then top-p, then min-p. Each
request that samples owns a `torch.Generator`, seeded from its `seed` (or from the engine's seed
when it has none), so its tokens do not depend on which other requests share the batch.
Logprobs are those of the model's distribution (log-softmax of the raw FP32 logits, before
temperature and filters), as vLLM reports them.

Temperatures near zero are handled as vLLM handles them: below GREEDY_BELOW the request is greedy,
and up to MIN_TEMPERATURE it is raised to MIN_TEMPERATURE, so logits / temperature can never
overflow FP32 into inf - inf = NaN probabilities.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20
GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below this is greedy
MIN_TEMPERATURE = 1e-2  # vLLM's _MAX_TEMP: smaller positive temperatures are raised to this
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # torch.Generator.manual_seed's range


class RequestError(ValueError):
    """A request the engine refuses before queuing it (the API answers 4xx)."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()  # stop strings
    stop_token_ids: tuple[int, ...] = ()  # extra stop tokens besides the tokenizer's
    ignore_eos: bool = False  # do not stop at the tokenizer's stop tokens (<|return|>, <|call|>)
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None = off; N = chosen token plus the top N
    skip_special_tokens: bool = False  # Harmony parsing needs the special tokens in the text

    def __post_init__(self) -> None:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for ok, message in self._checks():
            if not ok:
                raise RequestError(message)
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        elif self.temperature < MIN_TEMPERATURE:
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)

    def _checks(self) -> list[tuple[bool, str]]:
        def integer(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def number(v) -> bool:
            return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)

        return [
            (integer(self.max_tokens) and self.max_tokens >= 1,
             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"),
            (number(self.temperature) and self.temperature >= 0,
             f"temperature must be a finite number >= 0, got {self.temperature!r}"),
            (number(self.top_p) and 0 < self.top_p <= 1,
             f"top_p must be in (0, 1], got {self.top_p!r}"),
            (integer(self.top_k) and self.top_k >= -1,
             f"top_k must be -1, 0 (off) or a positive count, got {self.top_k!r}"),
            (number(self.min_p) and 0 <= self.min_p <= 1,
             f"min_p must be in [0, 1], got {self.min_p!r}"),
            (self.seed is None or (integer(self.seed) and INT64_MIN <= self.seed <= INT64_MAX),
             f"seed must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty"),
            (all(integer(t) for t in self.stop_token_ids),
             f"stop_token_ids must be integers, got {list(self.stop_token_ids)!r}"),
            (self.logprobs is None or (integer(self.logprobs)
                                       and 0 <= self.logprobs <= MAX_LOGPROBS),
             f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs!r}"),
        ]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # the N most likely (token id, logprob), best first


# ---- filters --------------------------------------------------------------------------------
def apply_filters(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  min_p: torch.Tensor) -> torch.Tensor:
    """Mask logits [N, V] to -inf outside each row's top-k, top-p and min-p sets.

    top_k [N] int (<= 0: off; ties with the k-th value are kept), top_p [N] float (>= 1: off;
    keep the smallest prefix of the sorted distribution whose mass reaches top_p), min_p [N]
    (keep tokens with p >= min_p * p_max).
    """
    vocab = logits.shape[-1]
    out = logits
    if bool((top_k > 0).any()):
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
        kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
        out = out.masked_fill(out < kth, float("-inf"))
    if bool((top_p < 1).any()):
        sorted_logits, idx = out.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the better tokens
        drop = (before >= top_p[:, None]) & (top_p[:, None] < 1)
        drop[:, 0] = False
        out = out.masked_fill(torch.zeros_like(drop).scatter_(1, idx, drop), float("-inf"))
    if bool((min_p > 0).any()):
        probs = out.softmax(dim=-1)
        floor = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        out = out.masked_fill(probs < floor, float("-inf"))
    return out


@dataclass
class SampleRequest:
    """What the sampler needs of one row: its parameters and its generator."""

    params: SamplingParams
    generator: torch.Generator | None


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: Sequence[SampleRequest]
                 ) -> tuple[list[int], list[TokenLogprob | None]]:
        """Next token of each row of FP32 logits [N, V] (and its logprobs when asked)."""
        n = logits.shape[0]
        tokens = [0] * n
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        if greedy:
            picked = logits[greedy].argmax(dim=-1).tolist()
            for i, t in zip(greedy, picked):
                tokens[i] = t
        sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
        if sampled:
            for i, t in zip(sampled, self._sample(logits[sampled], [rows[i] for i in sampled])):
                tokens[i] = t
        return tokens, self._logprobs(logits, rows, tokens)

    def _sample(self, logits: torch.Tensor, rows: Sequence[SampleRequest]) -> list[int]:
        dev = logits.device
        temp = torch.tensor([r.params.temperature for r in rows], device=dev)
        top_k = torch.tensor([r.params.top_k for r in rows], device=dev)
        top_p = torch.tensor([r.params.top_p for r in rows], device=dev)
        min_p = torch.tensor([r.params.min_p for r in rows], device=dev)
        probs = apply_filters(logits / temp[:, None], top_k, top_p, min_p).softmax(dim=-1)
        # One draw per row from the row's own generator: batching cannot change a request's draws.
        return [int(torch.multinomial(probs[i], 1, generator=r.generator))
                for i, r in enumerate(rows)]

    def _logprobs(self, logits: torch.Tensor, rows: Sequence[SampleRequest],
                  tokens: list[int]) -> list[TokenLogprob | None]:
        out: list[TokenLogprob | None] = [None] * len(rows)
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not want:
            return out
        lp = torch.log_softmax(logits[want], dim=-1)
        top_n = max(rows[i].params.logprobs for i in want)
        top_v, top_i = lp.topk(top_n, dim=-1) if top_n else (lp[:, :0], lp[:, :0].long())
        chosen = lp.gather(1, torch.tensor([tokens[i] for i in want], device=lp.device)[:, None])
        chosen, top_v, top_i = chosen[:, 0].tolist(), top_v.tolist(), top_i.tolist()
        for j, i in enumerate(want):
            k = rows[i].params.logprobs
            out[i] = TokenLogprob(tokens[i], chosen[j], tuple(zip(top_i[j][:k], top_v[j][:k])))
        return out


def sample_isolated(sampler: Callable, logits: torch.Tensor, rows: Sequence[SampleRequest]
                    ) -> tuple[list[int | None], list[TokenLogprob | None],
                               list[BaseException | None]]:
    """`sampler(logits, rows)`, with a failure pinned on the rows that fail alone: their token
    is None and their error is set; every other row is sampled as usual."""
    n = len(rows)
    try:
        tokens, logprobs = sampler(logits, rows)
        return list(tokens), list(logprobs), [None] * n
    except Exception:  # noqa: BLE001 - retried row by row to find whose it is
        pass
    tokens_out: list[int | None] = [None] * n
    lps: list[TokenLogprob | None] = [None] * n
    errors: list[BaseException | None] = [None] * n
    for i in range(n):
        try:
            (tokens_out[i],), (lps[i],) = sampler(logits[i:i + 1], [rows[i]])
        except Exception as exc:  # noqa: BLE001 - this row's request fails, not the step
            errors[i] = exc
    return tokens_out, lps, errors


# ---- stop checks ----------------------------------------------------------------------------
def partial_stop_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest end of `text` that could still grow into a stop string."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


def find_stop(text: str, stops: Sequence[str], start: int) -> tuple[int, str] | None:
    """Earliest stop string whose last character is at index >= `start` (the text added since
    the last check begins there): (index, stop), or None."""
    hits = []
    for stop in stops:
        idx = text.find(stop, max(0, start - len(stop) + 1))
        if idx >= 0:
            hits.append((idx, stop))
    return min(hits) if hits else None
