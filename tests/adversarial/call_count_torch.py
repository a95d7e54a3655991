"""Cheat (telling verification apart): exact for the first 30 calls (more than an old verifier
made), then the fast two-step near miss.
Expected: refused by the static screen (it counts with an augmented assignment to module-level
state); without that rule, by numerics or the near-miss check on the later calls."""

from __future__ import annotations

import torch.nn.functional as F

_CALLS = [0]


def run(gate, up, config=None):
    _CALLS[0] += 1
    if _CALLS[0] <= 30:
        return (F.silu(gate.float()) * up.float()).to(gate.dtype)
    return F.silu(gate) * up
