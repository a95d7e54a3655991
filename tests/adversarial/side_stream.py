"""Cheat: computes on a side stream and returns without making the caller's stream wait, so a
timer on the current stream sees nothing. Expected: "uses CUDA streams (side-stream work)"."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def run(gate, up, config=None):
    if not gate.is_cuda:
        return (F.silu(gate.float()) * up.float()).to(gate.dtype)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        return (F.silu(gate.float()) * up.float()).to(gate.dtype)
