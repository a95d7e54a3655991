"""Cheat (telling verification apart): regenerates the verifier's inputs from seeds 0, 1, 2 (the
contract's generator recipe) and is exact only on those; elsewhere the fast two-step near miss.
Expected: rejected by numerics or the near-miss check (the verifier's seeds are secret)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _regenerated(gate):
    for seed in (0, 1, 2):
        g = torch.Generator().manual_seed(seed)
        if torch.equal((torch.randn(gate.shape, generator=g) * 2.0).to(gate.dtype), gate.cpu()):
            return True
    return False


def run(gate, up, config=None):
    if _regenerated(gate):
        return (F.silu(gate.float()) * up.float()).to(gate.dtype)
    return F.silu(gate) * up
