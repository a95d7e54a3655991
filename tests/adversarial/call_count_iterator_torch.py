"""Cheat (telling verification apart), counting with an iterator: each call takes the next of a
million numbers; when they run out it computes in BF16 (the two-step near miss). Nothing is
assigned after import. Expected: rejected because its state changes from call to call."""

from __future__ import annotations

import torch.nn.functional as F

_TICKS = iter(range(1_000_000))


def run(gate, up, config=None):
    if next(_TICKS, None) is not None:
        return (F.silu(gate.float()) * up.float()).to(gate.dtype)
    return F.silu(gate) * up
