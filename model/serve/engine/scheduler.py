"""Continuous batching with chunked prefill, admission control and preemption by recompute.

Every step the scheduler fills a token budget (`max_num_batched_tokens`): first one token for each
running sequence that is decoding, then the next prompt chunk of running sequences still in
prefill, then new sequences from the queue (first come, first served) while the budget, the
`max_num_seqs` limit and the KV cache allow. A running sequence whose next tokens do not fit the
cache preempts the latest-arrived running sequence not yet scheduled in this step (or, if none is
left, itself): the victim's pages are freed and it goes back to the front of the queue with its
generated tokens kept, to be recomputed later. Nothing is ever dropped.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from .kv_cache import PagedKVCache


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_SEQ_IDS = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One request's tokens and how many of them have their KV in the cache."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: Status = Status.WAITING
    seq_id: int = field(default_factory=lambda: next(_SEQ_IDS))
    state: Any = None  # the engine's per-request bookkeeping

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_ids(self, start: int, stop: int) -> list[int]:
        p = len(self.prompt_ids)
        if stop <= p:
            return self.prompt_ids[start:stop]
        return (self.prompt_ids[start:] if start < p else []) + self.output_ids[max(start - p, 0):
                                                                               stop - p]

    @property
    def is_decoding(self) -> bool:
        return self.num_tokens - self.num_computed == 1


@dataclass
class ScheduledChunk:
    """Tokens [start, start + num_tokens) of a sequence, computed in this step; `sample`: the
    chunk reaches the sequence's last token, so the step samples its next one."""

    seq: Sequence
    start: int
    num_tokens: int
    token_ids: list[int] = field(init=False)
    sample: bool = field(init=False)

    def __post_init__(self) -> None:
        stop = self.start + self.num_tokens
        self.token_ids = self.seq.token_ids(self.start, stop)
        self.sample = stop == self.seq.num_tokens

    @property
    def seq_id(self) -> int:
        return self.seq.seq_id


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    preempted: list[Sequence]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1, got "
                             f"{self.max_num_seqs} and {self.max_num_batched_tokens}")


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: PagedKVCache) -> None:
        self.config = config
        self.cache = cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._arrival: dict[int, int] = {}
        self._order = itertools.count()
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self._arrival[seq.seq_id] = next(self._order)
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> Sequence | None:
        for seq in itertools.chain(self.running, self.waiting):
            if seq.request_id == request_id:
                return seq
        return None

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence, wherever it is, and free its pages."""
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
        elif seq.status == Status.WAITING:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        self.cache.free(seq.seq_id)
        self._arrival.pop(seq.seq_id, None)

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Sequence] = []
        done: set[int] = set()
        arrival = self._arrival
        # Decodes first (one token each keeps every stream moving), then prefill chunks.
        order = sorted(self.running, key=lambda s: (not s.is_decoding, arrival[s.seq_id]))
        for seq in order:
            if budget == 0:
                break
            if seq.status != Status.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_tokens - seq.num_computed, budget)
            if self._make_room(seq, n, done, preempted):
                chunks.append(self._take(seq, n))
                done.add(seq.seq_id)
                budget -= n
        # Admit new sequences only when nobody had to be preempted: memory is tight otherwise.
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            n = min(seq.num_tokens - seq.num_computed, budget)
            if not self.cache.can_allocate(seq.seq_id, n):
                break  # queued until pages come back
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            chunks.append(self._take(seq, n))
            budget -= n
        return SchedulerOutput(chunks, preempted)

    def _take(self, seq: Sequence, n: int) -> ScheduledChunk:
        chunk = ScheduledChunk(seq, seq.num_computed, n)
        self.cache.allocate(seq.seq_id, n)
        return chunk

    def _make_room(self, seq: Sequence, n: int, done: set[int],
                   preempted: list[Sequence]) -> bool:
        while not self.cache.can_allocate(seq.seq_id, n):
            victims = [s for s in self.running if s is not seq and s.seq_id not in done]
            victim = max(victims, key=lambda s: self._arrival[s.seq_id]) if victims else seq
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.cache.free(seq.seq_id)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.num_preemptions += 1
        # Back to the queue in arrival order, ahead of anything that arrived after it.
        rank = self._arrival[seq.seq_id]
        pos = next((i for i, s in enumerate(self.waiting) if self._arrival[s.seq_id] > rank),
                   len(self.waiting))
        self.waiting.insert(pos, seq)

    def advance(self, out: SchedulerOutput) -> None:
        """After the step ran: its tokens' KV is in the cache; drop window pages left behind."""
        for chunk in out.chunks:
            chunk.seq.num_computed = chunk.start + chunk.num_tokens
            self.cache.trim(chunk.seq_id)
