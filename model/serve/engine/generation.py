"""One API request through the engine: stop strings, the reasoning budget and forced headers.

The HTTP layer hands `run_generation` a `GenerationRequest` and reads back `TextChunk`s (raw
generated text with its special tokens, for the Harmony parser) and one final `Finished`. Choices:
- Stop strings are matched here on the raw generated text, not in the engine: the matched string
  and anything after it never reach the client, text that could still become a stop string is
  held back, and the engine request is aborted at the match.
- The text of a stop token (`<|return|>`, `<|call|>`) that ends generation is not emitted; the
  parser closes the message at the end of the text just as it would at the token.
- Reasoning budget (docs/format.md, REASONING_BUDGET): reasoning tokens are counted as they arrive;
  when a response has spent its budget the engine request is aborted and a new one continues from
  prompt + generated tokens + `<|end|><|start|>assistant`, so the model must go on to its answer
  or a tool call (the engine has no prefix cache, so that request prefills the context again).
  Usage counts only tokens the model generated; forced text is not counted.
- `after_reasoning` (tool_choice required/named): when the reasoning closes, the server appends
  that text (` to=` or ` to=NAME...<|message|>`) after `<|start|>assistant`, so a call follows.
  A stop token inside the reasoning is then replaced by `<|end|>` (still counted as generated).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from model.serve.engine.sampler import SamplingParams
from model.serve.harmony import CLOSERS, MESSAGE
from model.serve.tokenizer import BeamTokenizer, IncrementalDecoder

FORCE_CLOSE = "<|end|>"
NEXT_ASSISTANT = "<|start|>assistant"
MAX_FORCED_PHASES = 16  # a model that keeps reopening its reasoning is left alone after this


class EngineProtocol(Protocol):
    """What the HTTP layer needs from an engine (model.serve.engine.AsyncEngine has this shape).

    Optional: `start()`, `shutdown()`, `is_running`, `vocab_size` (the model's, for top_k)."""

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: Any
    ) -> AsyncIterator[Any]: ...

    def abort(self, request_id: str) -> Any: ...

    def stats(self) -> Any: ...


class TokenObserver(Protocol):
    """Told when tokens arrive (the HTTP layer's metrics have this shape)."""

    def first_token(self, arrival: float, now: float) -> None: ...

    def tokens(self, n: int, gap: float | None, now: float) -> None: ...


def make_sampling_params(**kwargs: Any) -> SamplingParams:
    """The engine's SamplingParams; raises its RequestError (a ValueError) for invalid values."""
    return SamplingParams(**kwargs)


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    max_model_len: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    skip_special_tokens: bool = False
    hidden_token_ids: frozenset[int] = frozenset()  # decode to "" (non-format special tokens)
    prefill: str = ""  # assistant text the prompt already ends with: parsed, never generated
    reasoning_budget: int | None = None  # None: no limit and no reasoning tracking
    after_reasoning: str | None = None


@dataclass
class TextChunk:
    text: str
    token_ids: list[int]
    logprobs: list[Any] | None = None


@dataclass
class Finished:
    reason: Literal["stop", "length", "abort"]
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int = 0
    stop_sequence: str | None = None


def partial_suffix(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers`."""
    if not markers or not text:
        return 0
    longest = max(len(m) for m in markers) - 1
    for start in range(max(0, len(text) - longest), len(text)):
        if any(m.startswith(text[start:]) for m in markers):
            return len(text) - start
    return 0


class StopMatcher:
    """Finds stop strings in streamed text, holding back what could still become one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """Text safe to emit, and the stop string matched (emit nothing after it)."""
        self._buf += text
        best, found = -1, None
        for stop in self.stops:
            pos = self._buf.find(stop)
            if pos >= 0 and (best < 0 or pos < best):
                best, found = pos, stop
        if found is not None:
            out, self._buf = self._buf[:best], ""
            return out, found
        cut = len(self._buf) - partial_suffix(self._buf, self.stops)
        out, self._buf = self._buf[:cut], self._buf[cut:]
        return out, None

    def flush(self) -> str:
        out, self._buf = self._buf, ""
        return out


class ReasoningTracker:
    """Counts reasoning tokens and sees where reasoning closes (headers of docs/format.md)."""

    def __init__(self, budget: int | None) -> None:
        self.budget = budget
        self.tokens = 0
        self._state: Literal["header", "reasoning", "body", "between"] = "header"
        self._buf = ""

    @property
    def in_reasoning(self) -> bool:
        return self._state == "reasoning"

    def over_budget(self) -> bool:
        return self.in_reasoning and self.budget is not None and self.tokens >= self.budget

    def feed(self, text: str, is_token: bool = True) -> Literal["closed", "budget"] | None:
        """Follow `text` (one token's, or forced text); say if reasoning closed or ran out."""
        self._buf += text
        closed = False
        # Only a token that arrives inside the reasoning counts: the one that opens it
        # (<|message|>) is a header token; special tokens are whole, so none carries both.
        counted = self._state != "reasoning"
        while True:
            if self._state == "header":
                pos = self._buf.find(MESSAGE)
                closer = min((p for p in (self._buf.find(c) for c in CLOSERS) if p >= 0),
                             default=-1)
                if closer >= 0 and (pos < 0 or closer < pos):
                    self._state, self._buf = "between", self._buf[closer:]
                    continue
                if pos < 0:
                    return "budget" if self.over_budget() else None
                header, self._buf = self._buf[:pos], self._buf[pos + len(MESSAGE):]
                analysis = "<|channel|>analysis" in header and "to=" not in header
                self._state = "reasoning" if analysis else "body"
            elif self._state in ("reasoning", "body"):
                ends = [(p, c) for c in CLOSERS if (p := self._buf.find(c)) >= 0]
                if not ends:
                    if self._state == "reasoning" and is_token and not counted:
                        self.tokens += 1
                        counted = True
                    # Keep a tail that may be the start of a closer written as plain text.
                    self._buf = self._buf[len(self._buf) - partial_suffix(self._buf, CLOSERS):]
                    break
                pos, closer = min(ends)
                closed = closed or self._state == "reasoning"
                self._state, self._buf = "between", self._buf[pos + len(closer):]
            else:  # between messages: wait for the next <|start|>
                pos = self._buf.find("<|start|>")
                if pos < 0:
                    self._buf = self._buf[len(self._buf) - partial_suffix(self._buf,
                                                                          ("<|start|>",)):]
                    return "closed" if closed else None
                self._state, self._buf = "header", self._buf[pos + len("<|start|>"):]
        if self.over_budget():
            return "budget"
        return "closed" if closed else None


def _new_token_ids(out: Any, seen: int) -> list[int]:
    new = getattr(out, "new_token_ids", None)
    if new is not None:
        return list(new)
    cumulative = getattr(out, "token_ids", None) or getattr(out, "output_token_ids", None) or []
    return list(cumulative[seen:])


async def _abort(engine: EngineProtocol, request_id: str) -> None:
    result = engine.abort(request_id)
    if inspect.isawaitable(result):
        await result


@dataclass
class _Run:
    """Mutable state of one request across its engine phases."""

    greq: GenerationRequest
    prompt: list[int]
    tracker: ReasoningTracker
    stopper: StopMatcher
    decoder: IncrementalDecoder
    completion: int = 0
    phase_tokens: int = 0  # tokens of the current engine request
    phases: int = 0
    forced_after: bool = False
    engine_finished: bool = False
    pending: str = ""  # text to emit with the next chunk (prefill, forced headers)
    vocab: int = 0  # ids from here up are not in the tokenizer
    last_token_at: float | None = None


async def run_generation(
    engine: EngineProtocol,
    tokenizer: BeamTokenizer,
    greq: GenerationRequest,
    request_id: str,
    metrics: TokenObserver | None = None,
    arrival: float | None = None,
) -> AsyncIterator[TextChunk | Finished]:
    """Drive `greq` through the engine; the first event comes after the engine's first output.

    Raises whatever the engine raises for an invalid request (before any event is yielded).
    Closing the iterator early (a client that went away) aborts the engine request.
    """
    arrival = time.monotonic() if arrival is None else arrival
    run = _Run(greq, list(greq.prompt_ids), ReasoningTracker(greq.reasoning_budget),
               StopMatcher(greq.stop), tokenizer.incremental_decoder(greq.skip_special_tokens),
               pending=greq.prefill, vocab=tokenizer.vocab_size)
    run.tracker.feed(greq.prefill, is_token=False)
    action: Literal["closed", "budget"] | None = None
    while True:
        if action == "closed":
            _force(run, tokenizer, "")
        elif action == "budget" or (run.tracker.over_budget() and run.phases < MAX_FORCED_PHASES):
            _force(run, tokenizer, FORCE_CLOSE)
        room = min(greq.max_tokens - run.completion, greq.max_model_len - len(run.prompt))
        if room <= 0:
            for event in _ending(run, "length"):
                yield event
            return
        rid = request_id if run.phases == 0 else f"{request_id}.{run.phases}"
        params = make_sampling_params(
            temperature=greq.temperature, top_p=greq.top_p, top_k=greq.top_k, min_p=greq.min_p,
            seed=greq.seed, max_tokens=room, stop=[], stop_token_ids=list(greq.stop_token_ids),
            logprobs=greq.logprobs,
        )
        events: list[TextChunk | Finished] = []
        stream = engine.generate(rid, list(run.prompt), params)
        run.engine_finished, run.phase_tokens, action, done = False, 0, None, None
        try:
            async for out in stream:
                done, action = _consume(run, out, events, metrics, arrival)
                for event in events:
                    yield event
                events.clear()
                if done is not None or action is not None:
                    break
        finally:
            if not run.engine_finished:
                await _abort(engine, rid)  # we stopped reading: a stop, a cut or a cancel
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
        if done is not None:
            yield done
            return
        if action is None:  # the engine ended without a finish reason
            for event in _ending(run, "abort"):
                yield event
            return
        run.phases += 1


def _ending(run: _Run, reason: Literal["length", "abort"]) -> list[TextChunk | Finished]:
    """Held-back text, then the Finished event."""
    text, run.pending = run.pending + _tail(run), ""
    return [TextChunk(text, []), _finish(run, reason)] if text else [_finish(run, reason)]


def _force(run: _Run, tokenizer: BeamTokenizer, close: str) -> None:
    """Append forced text to the prompt: close the reasoning, open the next assistant message."""
    tail, _ = run.stopper.feed(run.decoder.finish())
    run.decoder = tokenizer.incremental_decoder(run.greq.skip_special_tokens)
    after = ""
    if run.greq.after_reasoning is not None and not run.forced_after:
        after, run.forced_after = run.greq.after_reasoning, True
    text = close + NEXT_ASSISTANT + after
    run.prompt += tokenizer.encode(text)
    run.tracker.feed(text, is_token=False)
    run.pending += tail + run.stopper.flush() + text


def _finish(run: _Run, reason: Any, stop_sequence: str | None = None) -> Finished:
    return Finished(reason, len(run.greq.prompt_ids), run.completion, run.tracker.tokens,
                    stop_sequence)


def _consume(
    run: _Run,
    out: Any,
    events: list[TextChunk | Finished],
    metrics: TokenObserver | None,
    arrival: float,
) -> tuple[Finished | None, Literal["closed", "budget"] | None]:
    """Process one engine output into `events`; returns (Finished or None, forced action)."""
    greq = run.greq
    new = _new_token_ids(out, run.phase_tokens)
    run.phase_tokens += len(new)
    reason = getattr(out, "finish_reason", None)
    run.engine_finished = reason is not None
    now = time.monotonic()
    if metrics is not None and new:
        if run.last_token_at is None:
            metrics.first_token(arrival, now)
        metrics.tokens(len(new), None if run.last_token_at is None else now - run.last_token_at,
                       now)
        run.last_token_at = now
    logprobs = getattr(out, "logprobs", None)
    for i, tid in enumerate(new):
        run.completion += 1
        run.prompt.append(tid)
        lp = [logprobs[i]] if isinstance(logprobs, list) and i < len(logprobs) else None
        if tid in greq.stop_token_ids:
            if run.tracker.in_reasoning and greq.after_reasoning is not None \
                    and not run.forced_after:
                # A stop inside the reasoning while a tool call is required: the call must
                # still come, so the stop token is replaced by a forced close.
                run.prompt.pop()
                return None, "budget"
            events.append(TextChunk(run.pending + _tail(run), [tid], lp))
            run.pending = ""
            return _finish(run, "stop"), None
        # A model vocabulary can be larger than the tokenizer's (the demo checkpoint): such
        # ids decode to nothing, as tokenizers' own decode() does.
        hidden = tid >= run.vocab or tid in greq.hidden_token_ids
        text = "" if hidden else run.decoder.feed(tid)
        action = run.tracker.feed(text) if greq.reasoning_budget is not None else None
        emit, matched = run.stopper.feed(text)
        events.append(TextChunk(run.pending + emit, [tid], lp))
        run.pending = ""
        if matched is not None:
            return _finish(run, "stop", matched), None
        if action == "budget" and run.phases < MAX_FORCED_PHASES:
            return None, "budget"
        if action == "closed" and greq.after_reasoning is not None and not run.forced_after:
            return None, "closed"
    if reason is not None:
        events.append(TextChunk(run.pending + _tail(run), []))
        run.pending = ""
        return _finish(run, reason if reason in ("stop", "length") else "abort"), None
    return None, None


def _tail(run: _Run) -> str:
    """Flush the decoder and the stop matcher at the end of generation."""
    emit, matched = run.stopper.feed(run.decoder.finish())
    return emit if matched is not None else emit + run.stopper.flush()
