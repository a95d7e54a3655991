"""Which engine failures belong to one request, and which end the engine.

A request's own failure (its sampling, its detokenization, its part of a step) fails that
request alone: its stream ends with an error in its API's shape and the engine serves everyone
else. A failure of what all requests share (the scheduler's bookkeeping, the KV cache's page
tables, a device fault that poisons the CUDA context) stops the engine: `/health` turns 503 and
the server exits so that a supervisor restarts it.

A step that fails is re-run one chunk at a time: re-running a chunk rewrites the same KV slots
with the same values, so the chunks that succeed alone go on, and those that fail alone fail their
requests. If the step fails for every request it holds several steps running, the model itself is
broken, not a request: that is a shared failure too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

MAX_STEPS_FAILING_EVERY_REQUEST = 3
_DEVICE_FAULT_TEXT = ("CUDA error", "device-side assert", "illegal memory access", "NCCL error")


class EngineFatalError(RuntimeError):
    """An error that may have corrupted state every request shares; the engine must stop."""


def is_device_fault(exc: BaseException) -> bool:
    """Errors after which the device (its context, its memory) cannot be trusted again."""
    accel = getattr(torch, "AcceleratorError", None)
    if accel is not None and isinstance(exc, accel):
        return True
    return any(text in str(exc) for text in _DEVICE_FAULT_TEXT)


class StepIsolation:
    """Runs a step; on failure, re-runs each chunk alone to find the requests that fail."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled  # off under tensor parallelism: a re-run would desync the ranks
        self.failing_steps = 0

    def execute(self, runner: Any, chunks: Sequence[Any]
                ) -> tuple[torch.Tensor, dict[int, BaseException]]:
        """(FP32 logits of the sampling chunks that ran, {index in `chunks`: error})."""
        try:
            logits = runner.execute(chunks)
            self.failing_steps = 0
            return logits, {}
        except Exception as exc:
            if not self.enabled or is_device_fault(exc):
                raise EngineFatalError(f"the model step failed: {exc!r}") from exc
            first = exc
        rows, failed = [], {}
        for i, chunk in enumerate(chunks):
            if len(chunks) == 1:
                failed[i] = first
                continue
            try:
                out = runner.execute([chunk])
            except Exception as exc:  # noqa: BLE001 - this chunk's request fails
                if is_device_fault(exc):
                    raise EngineFatalError(f"the model step failed: {exc!r}") from exc
                failed[i] = exc
                continue
            if chunk.sample:
                rows.append(out)
        self._count(len(failed) == len(chunks), first)
        vocab = runner.model.shard.vocab_size
        empty = torch.empty(0, vocab, device=runner.device, dtype=torch.float32)
        return (torch.cat(rows) if rows else empty), failed

    def _count(self, all_failed: bool, exc: BaseException) -> None:
        self.failing_steps = self.failing_steps + 1 if all_failed else 0
        if self.failing_steps >= MAX_STEPS_FAILING_EVERY_REQUEST:
            raise EngineFatalError(
                f"the model step failed for every request of {self.failing_steps} steps in a row "
                f"(last: {exc!r}); the model, not a request, is failing") from exc
