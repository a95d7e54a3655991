"""Runs one scheduled step through the model: flat token batch in, FP32 logits out.

A step mixes single-token decodes and prefill chunks of any length. Tokens are laid out decodes
first (batched attention over padded page tables where enabled), then each other chunk (attention
per sequence through the `attention` op). Logits are computed only for the last token of each
chunk that samples. Decode-only steps replay a captured CUDA graph when `cuda_graphs` is on.
Attention runs through `PagedAttention` (torch) or, on a GPU, `FlashInferAttention`
(`attention_backend`: auto | torch | flashinfer), which `prepare` plans once per step.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import torch

from ..beam import BeamForCausalLM
from .engine.kv_cache import FULL, SWA, PagedKVCache
from .flashinfer_attention import make_backend
from .paged_attention import DecodeMeta, PagedBatch, SeqKeys

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


def _pad_rows(rows: Sequence[Sequence[int]], width: int) -> list[list[int]]:
    return [list(r) + [0] * (width - len(r)) for r in rows]


class ModelRunner:
    def __init__(self, model: BeamForCausalLM, cache: PagedKVCache, *, max_num_seqs: int,
                 max_model_len: int, cuda_graphs: bool = False,
                 batched_decode: bool | None = None, attention_backend: str = "auto") -> None:
        self.model = model
        self.cache = cache
        self.device = model.device
        self.max_model_len = max_model_len
        self.notes: list[str] = []
        # Batched decode attention on the GPU (one launch for all decodes); the CPU default keeps
        # every query on the `attention` op, the reference path.
        self.batched_decode = (self.device.type == "cuda") if batched_decode is None \
            else batched_decode
        if model.inv_freq is not None:
            # RoPE frequencies are computed on the CPU at init (NUMERICS.md); moving the FP32
            # values changes nothing and spares a host-to-device copy inside every step (and
            # inside CUDA-graph capture, where it is not allowed).
            model.inv_freq = model.inv_freq.to(self.device)
        # torch (PagedAttention) or FlashInfer (GPU); `auto` never imports FlashInfer off the GPU.
        backend, self.attention_backend, note = make_backend(
            attention_backend, cache, lambda: self.model.ops,
            num_qo_heads=model.shard.num_attention_heads, max_model_len=max_model_len)
        self.notes.append(note)
        model.attention_backend = backend
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
        """Host page tables (padded) of single-token chunks: (full rows, swa rows, swa bases)."""
        tables = [self.cache.page_tables(c.seq_id) for c in chunks]
        full_w = full_width or max((len(t[0]) for t in tables), default=1) or 1
        swa_w = swa_width or max((len(t[1]) for t in tables), default=1) or 1
        return (_pad_rows([t[0] for t in tables], full_w), _pad_rows([t[1] for t in tables], swa_w),
                [t[2] for t in tables])

    def prepare(self, chunks: Sequence[StepChunk]) -> tuple[torch.Tensor, torch.Tensor,
                                                            PagedBatch, list[int]]:
        """(ids [T], positions [T], batch, index of each chunk's last token) in `chunks` order;
        `chunks` must list batched decodes first (see `order`)."""
        dev, window = self.device, self.cache.layout.window
        ids, pos, full_w, swa_w, bounds, keys = [], [], [], [], [], []
        num_decode = sum(1 for c in chunks if self._batched(c)) if self.batched_decode else 0
        for i, c in enumerate(chunks):
            start, stop = c.start, c.start + c.num_tokens
            bounds.append((len(ids), len(ids) + c.num_tokens))
            ids += c.token_ids
            pos += range(start, stop)
            full_w += self.cache.slots(c.seq_id, FULL, start, stop)
            swa_w += self.cache.slots(c.seq_id, SWA, start, stop)
            if i >= num_decode:
                lo = max(0, start - window + 1) if window else 0
                keys.append(SeqKeys(_long(self.cache.slots(c.seq_id, FULL, 0, stop), dev),
                                    _long(self.cache.slots(c.seq_id, SWA, lo, stop), dev), lo))
        meta = None
        if num_decode:
            ft, st, base = self.decode_meta(chunks[:num_decode])
            meta = DecodeMeta(_long(ft, dev), _long(st, dev), _long(base, dev))
        batch = PagedBatch(_long(pos, dev), bounds, _long(full_w, dev), _long(swa_w, dev),
                           num_decode, meta, keys)
        plan = getattr(self.model.attention_backend, "plan_step", None)
        if plan is not None:  # FlashInfer: page tables once per step, shared by every layer
            plan(chunks, num_decode)
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
