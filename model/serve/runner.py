"""Runs one scheduled step through the model: flat token batch in, FP32 logits out.

A step mixes single-token decodes and prefill chunks of any length, laid out chunk by chunk
(decodes first where `batched_decode` orders them so). `prepare` describes the step once per
KV pool (page-table rows, first positions, the new tokens' slots; `PoolMeta`), and every layer's
Q/K norm op writes K/V and its `attention` op reads them through `PagedAttention`. Which
attention kernel runs is the registry's choice for the op (`attention_backend` overrides it:
model/serve/attention_backends.py). Logits are computed only for the last token of each chunk
that samples. Decode-only steps replay a captured CUDA graph when `cuda_graphs` is on.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import torch

from ..beam import BeamForCausalLM
from . import attention_backends
from .engine.kv_cache import FULL, SWA, PagedKVCache
from .paged_attention import PagedAttention, PagedBatch, PoolMeta, pad_rows

log = logging.getLogger(__name__)


class StepChunk(Protocol):
    """Tokens [start, start + num_tokens) of sequence `seq_id` (scheduler.ScheduledChunk)."""

    seq_id: int
    start: int
    num_tokens: int
    token_ids: list[int]
    sample: bool


def _long(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


class ModelRunner:
    def __init__(self, model: BeamForCausalLM, cache: PagedKVCache, *, max_num_seqs: int,
                 max_model_len: int, cuda_graphs: bool = False,
                 batched_decode: bool | None = None, attention_backend: str = "auto",
                 registry: str | None = None) -> None:
        self.model = model
        self.cache = cache
        self.device = model.device
        self.max_model_len = max_model_len
        self.notes: list[str] = []
        # Decodes first on the GPU (the layout CUDA graphs replay); the CPU keeps chunk order.
        self.batched_decode = (self.device.type == "cuda") if batched_decode is None \
            else batched_decode
        if model.inv_freq is not None:
            # RoPE frequencies are computed on the CPU at init (docs/numerics.md); moving the FP32
            # values changes nothing and spares a host-to-device copy inside every step (and
            # inside CUDA-graph capture, where it is not allowed).
            model.inv_freq = model.inv_freq.to(self.device)
        # The attention op's implementation: the lock's, or the one --attention-backend names.
        ops, note = attention_backends.select(attention_backend, model.ops, self.device,
                                              model.dtype, registry)
        model.set_ops(ops)
        self.attention_backend = attention_backend
        self.notes.append(note)
        model.attention_backend = PagedAttention(cache, lambda: self.model.ops)
        self.graphs = None
        if cuda_graphs and self.device.type == "cuda":
            from .graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self, max_num_seqs)
            self.notes += self.graphs.capture()
            if not self.graphs.ready:
                self.graphs = None

    # ---- batch building ---------------------------------------------------------------------
    def decode_meta(self, chunks: Sequence[StepChunk], full_width: int | None = None,
                    swa_width: int | None = None) -> tuple[list, list, list]:
        """Host page tables of chunks, padded with the null page: (full rows, window rows,
        position of each window row's first slot)."""
        tables = [self.cache.page_tables(c.seq_id) for c in chunks]
        full_w = full_width or max((len(t[0]) for t in tables), default=1) or 1
        swa_w = swa_width or max((len(t[1]) for t in tables), default=1) or 1
        return (pad_rows([t[0] for t in tables], full_w), pad_rows([t[1] for t in tables], swa_w),
                [t[2] for t in tables])

    def prepare(self, chunks: Sequence[StepChunk]) -> tuple[torch.Tensor, torch.Tensor,
                                                            PagedBatch, list[int]]:
        """(ids [T], positions [T], batch, index of each chunk's last token) in `chunks` order;
        every chunk's pages must be allocated for this step."""
        dev = self.device
        ids, pos, q_seq, bounds = [], [], [], []
        writes: dict[str, list[int]] = {FULL: [], SWA: []}
        for i, c in enumerate(chunks):
            start, stop = c.start, c.start + c.num_tokens
            bounds.append((len(ids), len(ids) + c.num_tokens))
            ids += c.token_ids
            pos += range(start, stop)
            q_seq += [i] * c.num_tokens
            for group in (FULL, SWA):
                writes[group] += self.cache.slots(c.seq_id, group, start, stop)
        full, swa, base = self.decode_meta(chunks)
        zeros = [0] * len(chunks)  # full-attention rows start at position 0
        pools = {FULL: PoolMeta(_long(full, dev), _long(zeros, dev), _long(writes[FULL], dev)),
                 SWA: PoolMeta(_long(swa, dev), _long(base, dev), _long(writes[SWA], dev))}
        num_decode = sum(1 for c in chunks if self._batched(c)) if self.batched_decode else 0
        batch = PagedBatch(_long(pos, dev), bounds, _long(q_seq, dev), pools, num_decode)
        return _long(ids, dev), batch.positions, batch, [b[1] - 1 for b in bounds]

    @staticmethod
    def _batched(chunk: StepChunk) -> bool:
        return chunk.num_tokens == 1

    def order(self, chunks: Sequence[StepChunk]) -> list[int]:
        """Indices of `chunks` with single-token chunks first (the batched-decode layout)."""
        if not self.batched_decode:
            return list(range(len(chunks)))
        first = [i for i, c in enumerate(chunks) if self._batched(c)]
        return first + [i for i, c in enumerate(chunks) if not self._batched(c)]

    # ---- execution --------------------------------------------------------------------------
    @torch.no_grad()
    def execute(self, chunks: Sequence[StepChunk]) -> torch.Tensor:
        """FP32 logits [n, V] for the chunks that sample, in the order they appear in `chunks`."""
        if not chunks:
            return torch.empty(0, self.model.shard.vocab_size, device=self.device)
        if self.graphs is not None and self.graphs.covers(chunks):
            logits = self.graphs.run(chunks)
            return logits[[i for i, c in enumerate(chunks) if c.sample]]
        return self.execute_eager(chunks)

    @torch.no_grad()
    def execute_eager(self, chunks: Sequence[StepChunk]) -> torch.Tensor:
        order = self.order(chunks)
        ordered = [chunks[i] for i in order]
        ids, positions, batch, last = self.prepare(ordered)
        hidden = self.model.forward_tokens(ids, positions, batch)  # [T, H]
        rows = [j for j, c in enumerate(ordered) if c.sample]
        logits = self.model.compute_logits(hidden[last][rows])  # [n, V] FP32
        # Back to the callers' order of sampling chunks.
        where = {order[j]: r for r, j in enumerate(rows)}
        back = [where[i] for i, c in enumerate(chunks) if c.sample]
        return logits if back == sorted(back) else logits[back]
