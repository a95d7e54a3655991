"""Batch-invariant execution: a request's tokens do not depend on what it is batched with.

In BF16 a token's logits can change by an ulp with the step it runs in: a GEMM's kernel and its
K-reduction order depend on the row count (oneDNN/AMX on CPUs, cuBLAS on GPUs), an elementwise
op takes its vector or scalar path by the tensor's size, a prefill chunk and a decode reach the
same keys through different shapes. Greedy decoding amplifies an ulp into a different token now
and then: alone, batched, or recomputed after a preemption, a request can answer differently.

`TokenwiseRunner` removes every such dependence at once: it runs each token of a step as its own
forward of exactly one token (a decode-shaped step), in the step's order. A token at position p
of a sequence then goes through the same calls with the same shapes whatever else is scheduled
and whether it arrived in a prompt, as a decode, or in a recompute after preemption; its K/V
entries are identical, so are the keys its successors read. Deterministic kernels do the rest.
The price is batching itself: a step of n tokens costs n single-token forwards
(benchmarks/batch_invariant_bench.py measures it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TokenChunk:
    """One token of a scheduled chunk (runner.StepChunk)."""

    seq_id: int
    start: int
    num_tokens: int
    token_ids: list[int]
    sample: bool


class TokenwiseRunner:
    """A ModelRunner that runs every token of a step as a forward of its own."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.notes = [*runner.notes, "batch-invariant: one forward per token"]

    def execute(self, chunks: Sequence[Any]) -> torch.Tensor:
        """FP32 logits [n, V] of the chunks that sample, in their order (runner.execute)."""
        rows = []
        for c in chunks:
            for j, token in enumerate(c.token_ids):
                samples = c.sample and j == c.num_tokens - 1
                out = self.runner.execute([TokenChunk(c.seq_id, c.start + j, 1, [token],
                                                      samples)])
                if samples:
                    rows.append(out)
        if not rows:
            return torch.empty(0, self.runner.model.shard.vocab_size, device=self.runner.device)
        return torch.cat(rows)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)
