"""Cheat (telling verification apart), counting in a closure cell: exact for its first million
calls, far more than any verification makes, then the fast two-step near miss. No module-level
name changes and no augmented assignment touches one, so the static screen has nothing to refuse.
Expected: rejected because its state changes from call to call."""

from __future__ import annotations

import torch.nn.functional as F


def _counting():
    box = [0]

    def run(gate, up, config=None):
        box[0] += 1
        if box[0] <= 1_000_000:
            return (F.silu(gate.float()) * up.float()).to(gate.dtype)
        return F.silu(gate) * up

    return run


run = _counting()
