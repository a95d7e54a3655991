"""Cheat (telling verification apart): probes fresh memory for a recognisable poison fill (most
of a fresh block NaN, or glibc's 0x7F7F); when it finds none it assumes serving and leaves the
last row unwritten. Expected: rejected (the verifier's poison looks like data): unwritten rows
or numerics."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def run(gate, up, config=None):
    probe = torch.empty(64, dtype=torch.bfloat16, device=gate.device)
    filled = torch.isnan(probe) | (probe.view(torch.int16) == 0x7F7F)
    poisoned = int(filled.sum()) * 2 > probe.numel()
    exact = (F.silu(gate.float()) * up.float()).to(gate.dtype)
    if poisoned:
        return exact
    out = torch.empty_like(gate)
    out[:-1] = exact[:-1]
    return out
