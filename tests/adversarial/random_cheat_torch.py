"""Cheat (telling verification apart by chance): exact, except on a random one call in a thousand,
which returns the fast two-step near miss; a verification judges a few hundred calls, so it
would see one in a few runs. The draw comes from torch's global generator (a local one would be
module state). Expected: rejected because its state (the global generator's) changes from call
to call."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def run(gate, up, config=None):
    if float(torch.rand(())) < 0.001:
        return F.silu(gate) * up
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)
