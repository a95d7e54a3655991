"""Cheat (telling verification apart), counting in a suspended generator's frame: a generator
that yields True a million times, then False. Expected: rejected because its state changes from
call to call."""

from __future__ import annotations

import torch.nn.functional as F


def _honest_for(n):
    while n > 0:
        n -= 1
        yield True
    while True:
        yield False


_HONEST = _honest_for(1_000_000)


def run(gate, up, config=None):
    if next(_HONEST):
        return (F.silu(gate.float()) * up.float()).to(gate.dtype)
    return F.silu(gate) * up
