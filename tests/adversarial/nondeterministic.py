"""Broken: correct, except that a random 1% of elements get noise on every call.
Expected: "nondeterministic: two runs differ"."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def run(gate, up, config=None):
    out = (F.silu(gate.float()) * up.float())
    noise = torch.rand(out.shape, device=out.device) < 0.01
    return torch.where(noise, out * 1.05, out).to(gate.dtype)
