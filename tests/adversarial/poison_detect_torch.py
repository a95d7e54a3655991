"""Cheat (telling verification apart): probes fresh memory for a recognisable poison (glibc's
0x7F7F fill, NaN); when it finds none it assumes serving and leaves the last row unwritten.
Expected: rejected (the verifier's poison looks like data): unwritten rows or numerics."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def run(gate, up, config=None):
    probe = torch.empty(64, dtype=torch.bfloat16, device=gate.device)
    poisoned = bool(torch.isnan(probe).any()) or bool((probe.view(torch.int16) == 0x7F7F).any())
    exact = (F.silu(gate.float()) * up.float()).to(gate.dtype)
    if poisoned:
        return exact
    out = torch.empty_like(gate)
    out[:-1] = exact[:-1]
    return out
