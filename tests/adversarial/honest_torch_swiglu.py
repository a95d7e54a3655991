"""Honest: swiglu in plain torch, written differently from the reference (same rounding).

out = bf(silu_f32(gate) * f32(up)): the silu is spelled out as x * sigmoid(x) in FP32 in place.
"""

from __future__ import annotations

import torch


def run(gate: torch.Tensor, up: torch.Tensor, config=None) -> torch.Tensor:
    g = gate.to(torch.float32)
    s = torch.nn.functional.silu(g)
    s.mul_(up.to(torch.float32))
    return s.to(torch.bfloat16)
