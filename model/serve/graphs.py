"""CUDA-graph capture of decode steps, one graph per batch-size bucket.

A decode step of n sequences pads to the smallest bucket >= n and replays that bucket's graph over
static input buffers. Padded rows read and write only the null page 0, and their logits are
dropped. The full-attention page tables are as wide as `max_model_len` needs, so a graph serves
any context; the window tables as wide as one window needs.

Capture needs every op to be free of host syncs. The reference `moe_experts` loops over the
experts present (`unique().tolist()`), so while it is the selected implementation nothing is
captured and the runner decodes eagerly, saying why; the registry's moe_experts variants
(`grouped_mm_v2`, `triton_v1` to `triton_v3`) are capturable and are selected through the
lock like any other kernel. A capture that still fails leaves the runner eager and says why.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

from ..ops import OpTable
from .engine.kv_cache import FULL, SWA
from .paged_attention import PagedBatch, PoolMeta, check_width, pad_rows

log = logging.getLogger(__name__)

# Ops whose reference syncs with the host, and so cannot be captured.
HOST_SYNC_REFERENCES = {"moe_experts": "loops over the experts present (a host sync)"}


def uncapturable(ops: OpTable) -> list[str]:
    """Why `ops` cannot be captured: ops that run a reference that syncs with the host."""
    return [f"{op} runs its reference, which {why}" for op, why in HOST_SYNC_REFERENCES.items()
            if ops.sources.get(op) == "reference"]


def batch_buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 16, 16))
    return sorted({min(s, max_num_seqs) for s in sizes})


class DecodeGraphs:
    def __init__(self, runner, max_num_seqs: int) -> None:
        self.runner = runner
        self.buckets = batch_buckets(max_num_seqs)
        layout, dev = runner.cache.layout, runner.device
        self.full_width = math.ceil(runner.max_model_len / layout.page_size)
        # A decode at position p reads keys [p - window + 1, p]: window tokens, at most this many
        # pages when they straddle page edges.
        self.swa_width = math.ceil(layout.window / layout.page_size) + 1 if layout.window else 1
        b = self.buckets[-1]
        self.ids = torch.zeros(b, dtype=torch.long, device=dev)
        self.positions = torch.zeros(b, dtype=torch.long, device=dev)
        self.full_write = torch.zeros(b, dtype=torch.long, device=dev)
        self.swa_write = torch.zeros(b, dtype=torch.long, device=dev)
        self.full_table = torch.zeros(b, self.full_width, dtype=torch.long, device=dev)
        self.swa_table = torch.zeros(b, self.swa_width, dtype=torch.long, device=dev)
        self.swa_base = torch.zeros(b, dtype=torch.long, device=dev)
        self.full_base = torch.zeros(b, dtype=torch.long, device=dev)  # stays 0
        self.q_seq = torch.arange(b, dtype=torch.long, device=dev)  # row r is sequence r
        # The full-attention tables on the host, kept from step to step: a decode step appends
        # at most one page to a sequence, so a row is rewritten only when its sequence changes
        # (rebuilding [b, full_width] from Python lists costs ~25 ms at 32 x 100k tokens).
        # `_full_rows[r]` is (the page list row r was written from, entries written from it).
        self._full_host = torch.zeros(b, self.full_width, dtype=torch.long)
        self._full_rows: list[tuple[list[int], int] | None] = [None] * b
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.ready = False
        self.replay = True  # False: run the same padded forward eagerly (tests compare the two)

    def covers(self, chunks: Sequence) -> bool:
        return (self.ready and len(chunks) <= self.buckets[-1]
                and all(c.num_tokens == 1 for c in chunks))

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def forward(self, b: int) -> torch.Tensor:
        """The decode forward over the first b static rows -> FP32 logits [b, V]."""
        pools = {FULL: PoolMeta(self.full_table[:b], self.full_base[:b], self.full_write[:b]),
                 SWA: PoolMeta(self.swa_table[:b], self.swa_base[:b], self.swa_write[:b])}
        batch = PagedBatch(self.positions[:b], [(i, i + 1) for i in range(b)], self.q_seq[:b],
                           pools, b)
        model = self.runner.model
        return model.compute_logits(model.forward_tokens(self.ids[:b], self.positions[:b], batch))

    def load(self, chunks: Sequence) -> int:
        """Copy the step's inputs into the static buffers; padded rows use page 0 only."""
        n, b = len(chunks), self.bucket(len(chunks))
        cache = self.runner.cache
        tables = [cache.page_tables(c.seq_id) for c in chunks]
        check_width([t[0] for t in tables], self.full_width)
        swa = pad_rows([t[1] for t in tables], self.swa_width)
        pad = b - n
        pos = [c.start for c in chunks]
        rows = {
            self.ids: [c.token_ids[0] for c in chunks],
            self.positions: pos,
            self.full_write: [cache.slots(c.seq_id, FULL, p, p + 1)[0]
                              for c, p in zip(chunks, pos)],
            self.swa_write: [cache.slots(c.seq_id, SWA, p, p + 1)[0] for c, p in zip(chunks, pos)],
            self.swa_base: [t[2] for t in tables],
        }
        for buf, values in rows.items():
            buf[:b].copy_(torch.tensor(values + [0] * pad, dtype=torch.long))
        for r in range(b):
            self._load_full_row(r, tables[r][0] if r < n else None)
        self.full_table[:b].copy_(self._full_host[:b])
        self.swa_table[:b].copy_(torch.tensor(swa + [[0] * self.swa_width] * pad))
        return b

    def _load_full_row(self, r: int, pages: list[int] | None) -> None:
        """Row r of the host full table := `pages` padded with 0 (None: all 0). A sequence's
        full page list only grows while it lives (a freed or preempted sequence gets a new
        list), so the same list object as last step needs only its new entries. A row with
        nothing held is all 0."""
        held = self._full_rows[r]
        host = self._full_host[r]
        n = len(pages) if pages is not None else 0
        if held is not None and held[0] is pages and held[1] <= n:
            if n > held[1]:
                host[held[1]:n] = torch.tensor(pages[held[1]:], dtype=torch.long)
        else:
            if n:
                host[:n] = torch.tensor(pages, dtype=torch.long)
            if held is not None and held[1] > n:
                host[n:held[1]] = 0
        self._full_rows[r] = (pages, n) if pages is not None else None

    @torch.no_grad()
    def run(self, chunks: Sequence, replay: bool | None = None) -> torch.Tensor:
        """Logits [n, V] of a decode step; `replay=False` runs the same padded static-buffer
        forward eagerly (what the graph captured; CPU tests use it)."""
        b = self.load(chunks)
        if self.replay if replay is None else replay:
            self.graphs[b].replay()
            return self.logits[b][: len(chunks)].clone()
        return self.forward(b)[: len(chunks)]

    @torch.no_grad()
    def capture(self) -> list[str]:
        """Capture every bucket, largest first, sharing one memory pool."""
        model = self.runner.model
        blocked = uncapturable(model.ops)
        if blocked:
            msg = (f"CUDA graphs not captured, decoding eagerly: {'; '.join(blocked)}. Lock a "
                   "capturable variant for this GPU's arch: record it here first (e.g. "
                   "`autoopt registry record moe_experts grouped_mm_v2 --device cuda`, then "
                   "`autoopt registry accept moe_experts grouped_mm_v2`)")
            log.warning(msg)
            return [msg]
        pool = torch.cuda.graph_pool_handle()
        try:
            for b in reversed(self.buckets):
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):  # warm-up: cuBLAS workspaces, lazy inits
                        self.forward(b)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.logits[b] = self.forward(b)
                self.graphs[b] = graph
        except Exception as exc:  # any op that syncs with the host fails capture; stay eager
            self.graphs.clear()
            self.logits.clear()
            msg = f"CUDA-graph capture failed, decoding eagerly: {exc}"
            log.warning(msg)
            return [msg]
        torch.cuda.synchronize()
        self.ready = True
        return [f"CUDA graphs captured for decode batch sizes {self.buckets}"]
