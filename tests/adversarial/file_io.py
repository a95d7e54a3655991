"""Cheat: reads precomputed outputs from a file (and writes them). Expected: "open()"."""

from __future__ import annotations

import torch


def run(gate, up, config=None):
    with open("/tmp/autoopt-cheat.txt", "w") as f:
        f.write(str(gate.sum().item()))
    return torch.zeros_like(gate)
