"""CUDA-graph capture of decode steps, one graph per batch-size bucket.

A decode step of n sequences pads to the smallest bucket >= n and replays that bucket's graph over
static input buffers. Padded rows read and write only the null page 0, and their logits are
dropped. The full-attention page tables are as wide as `max_model_len` needs, so a graph serves
any context; the window tables as wide as one window needs.

Capture needs every op to be free of host syncs. The reference `moe_experts` loops over the
experts present (`unique().tolist()`), so when it is the selected implementation the runner swaps
in `grouped_moe_experts`: the same contract through `grouped_mm` with static shapes (the layout of
transformers' `grouped_mm` experts backend), equal to the reference up to GEMM reduction order.
A capture that still fails leaves the runner eager and says why.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..ops import OP_NAMES, OpTable
from ..ops.moe_experts import combine
from ..ops.swiglu import reference as swiglu
from .kv_cache import FULL, SWA
from .paged_attention import PagedBatch, PoolMeta

log = logging.getLogger(__name__)

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_moe_experts(x, gate_up, down, weights, ids, scale: float, expert_offset: int = 0):
    """`moe_experts` contract with static shapes: (token, slot) pairs sorted by expert, two
    grouped GEMMs, then the reference combine. Slots naming experts not held here give zero."""
    t, k = ids.shape
    e, h = gate_up.shape[0], x.shape[1]
    local = (ids - expert_offset).reshape(-1)
    held = (local >= 0) & (local < e)
    key = torch.where(held, local, e)  # experts held elsewhere sort last, past every group
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(e + 1, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    offs = counts[:e].cumsum(0, dtype=torch.int32)
    xs = x[order // k]  # [T*k, H]
    gu = _grouped_mm(xs, gate_up.transpose(1, 2), offs=offs)  # [T*k, 2I]
    inter = gu.shape[1] // 2
    d = _grouped_mm(swiglu(gu[:, :inter], gu[:, inter:]), down.transpose(1, 2), offs=offs)
    # Rows past offs[-1] (experts held elsewhere) are left unwritten by grouped_mm: zero them.
    d = torch.where(held[order][:, None], d, torch.zeros((), dtype=d.dtype, device=d.device))
    slots = torch.empty_like(d).index_copy_(0, order, d).view(t, k, h)
    return combine(slots, weights, scale)


def capture_safe_ops(ops: OpTable, dtype: torch.dtype) -> tuple[OpTable, list[str]]:
    # grouped_mm on CUDA takes BF16; other dtypes keep the reference (and capture then fails).
    if (ops.sources.get("moe_experts") != "reference" or _grouped_mm is None
            or dtype != torch.bfloat16):
        return ops, []
    impls = {name: ops.impl(name) for name in OP_NAMES}
    impls["moe_experts"] = grouped_moe_experts
    sources = {**ops.sources, "moe_experts": "grouped_mm (capture-safe, model/serve/graphs.py)"}
    table = OpTable(impls, sources)
    for key, value in vars(ops).items():  # what the registry attached (`resolution`, ...)
        if key not in ("_impls", "sources"):
            setattr(table, key, value)
    return table, ["moe_experts: reference swapped for grouped_mm so that "
                                     "decode can be captured in CUDA graphs"]


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
        full, swa, base = self.runner.decode_meta(chunks, self.full_width, self.swa_width)
        pad = b - n
        pos = [c.start for c in chunks]
        rows = {
            self.ids: [c.token_ids[0] for c in chunks],
            self.positions: pos,
            self.full_write: [cache.slots(c.seq_id, FULL, p, p + 1)[0]
                              for c, p in zip(chunks, pos)],
            self.swa_write: [cache.slots(c.seq_id, SWA, p, p + 1)[0] for c, p in zip(chunks, pos)],
            self.swa_base: base,
        }
        for buf, values in rows.items():
            buf[:b].copy_(torch.tensor(values + [0] * pad, dtype=torch.long))
        self.full_table[:b].copy_(torch.tensor(full + [[0] * self.full_width] * pad))
        self.swa_table[:b].copy_(torch.tensor(swa + [[0] * self.swa_width] * pad))
        return b

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
        eager_ops = model.ops
        ops, notes = capture_safe_ops(eager_ops, model.dtype)
        model.set_ops(ops)
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
            model.set_ops(eager_ops)
            notes = []
            msg = f"CUDA-graph capture failed, decoding eagerly: {exc}"
            log.warning(msg)
            return notes + [msg]
        torch.cuda.synchronize()
        self.ready = True
        return notes + [f"CUDA graphs captured for decode batch sizes {self.buckets}"]
