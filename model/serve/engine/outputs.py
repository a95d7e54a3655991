"""What the engine hands out: per-step request outputs, offline results, engine statistics; and
the per-request bookkeeping that turns sampled tokens into them (detokenization, stop checks)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .sampler import SampleRequest, SamplingParams, TokenLogprob, find_stop, partial_stop_suffix

FINISH_REASONS = ("stop", "length", "abort", "error")  # error: failed alone (faults.py)


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (its step, sampling or detokenization); the engine
    goes on. The message names the request and the stage, never the exception's text."""

    def __init__(self, request_id: str, stage: str) -> None:
        super().__init__(f"request {request_id} failed while {stage}")
        self.request_id = request_id
        self.stage = stage


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request (incremental), plus the running totals."""

    request_id: str
    new_token_ids: list[int]
    token_ids: list[int]  # every generated token so far (a matched stop token included)
    text_delta: str  # new visible text ("" without a tokenizer)
    text: str  # visible text so far: stop strings / stop tokens cut unless asked to include
    finished: bool
    finish_reason: str | None  # None, "stop", "length", "abort", "error"
    stop_reason: int | str | None  # the stop token id or stop string that matched
    logprobs: list[TokenLogprob] | None  # one per new token, when asked for
    prompt_tokens: int
    completion_tokens: int
    arrival_time: float  # time.monotonic() at add_request
    first_token_time: float | None
    time: float  # time.monotonic() when this output was made (ITL = difference of these)
    error: str | None = None  # with finish_reason "error": what failed ("sampling its ...")


@dataclass(frozen=True)
class CompletionResult:
    """A finished request from `LLMEngine.generate`."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    stop_reason: int | str | None
    logprobs: list[TokenLogprob] | None
    arrival_time: float
    first_token_time: float | None
    finish_time: float


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of the fuller page pool in use
    kv_capacity_tokens: int
    max_model_len: int
    num_preemptions: int  # this and the fields below: totals since the engine started
    prompt_tokens_total: int
    generation_tokens_total: int
    requests_added_total: int
    requests_finished_total: dict[str, int]  # by finish reason
    steps_total: int
    batched_tokens_total: int


@dataclass
class RequestState:
    """Per-request bookkeeping the engine keeps beside the scheduler's Sequence."""

    params: SamplingParams
    sample: SampleRequest
    stop_ids: frozenset[int]
    decoder: object | None  # tokenizer.IncrementalDecoder
    arrival_time: float
    max_len: int  # prompt + max_tokens, capped by max_model_len
    decode_vocab: int = 0  # ids from here up are not in the tokenizer and decode to nothing
    first_token_time: float | None = None
    text: str = ""
    emitted: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    error: str | None = None

    def add_token(self, token: int, num_generated: int, num_tokens: int) -> str:
        """Account for one sampled token; returns the text delta that becomes visible."""
        p = self.params
        if token in self.stop_ids:
            self.finish_reason, self.stop_reason = "stop", token
            if p.include_stop_str_in_output:
                self._feed(token)
        else:
            old = len(self.text)
            self._feed(token)
            self._check_stop_strings(old)
        if self.finish_reason is None and (num_generated >= p.max_tokens
                                           or num_tokens >= self.max_len):
            self.finish_reason = "length"
        if self.finish_reason is not None:
            self.flush()
        return self._emit()

    def flush(self) -> None:
        # Bytes held for an unfinished character belong to earlier tokens; after a stop string
        # the text is cut there and nothing later is shown.
        if self.decoder is not None and not isinstance(self.stop_reason, str):
            old = len(self.text)
            self.text += self.decoder.finish()
            self._check_stop_strings(old)

    def _feed(self, token: int) -> None:
        # A model vocabulary larger than the tokenizer's (the demo checkpoint): such ids decode
        # to nothing, as tokenizers' own decode() does.
        if self.decoder is not None and token < self.decode_vocab:
            self.text += self.decoder.feed(token)

    def _check_stop_strings(self, old_len: int) -> None:
        if not self.params.stop or self.finish_reason == "stop":
            return
        hit = find_stop(self.text, self.params.stop, old_len)
        if hit is not None:
            idx, stop = hit
            self.text = self.text[: idx + (len(stop) if self.params.include_stop_str_in_output
                                           else 0)]
            self.finish_reason, self.stop_reason = "stop", stop

    def _emit(self) -> str:
        """Text not shown yet, holding back an end that may still become a stop string."""
        hold = 0 if self.finish_reason else partial_stop_suffix(self.text, self.params.stop)
        visible = len(self.text) - hold
        delta = self.text[self.emitted: visible]
        self.emitted = max(self.emitted, visible)
        return delta

