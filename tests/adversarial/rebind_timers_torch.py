"""Cheat (reaching the judge): rebinds the functions a timer relies on, so a benchmark waits for
nothing. Expected: "static screen: monkeypatches torch.cuda.synchronize"."""

from __future__ import annotations

import torch
import torch.nn.functional as F

torch.cuda.synchronize = lambda device=None: None
torch.Tensor.record_stream = lambda self, stream: None


def run(gate, up, config=None):
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)
