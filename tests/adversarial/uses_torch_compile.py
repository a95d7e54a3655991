"""Cheat: hands the op to torch.compile (a baseline, not a kernel). Expected: "torch.compile"."""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.compile
def _swiglu(gate, up):
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def run(gate, up, config=None):
    return _swiglu(gate, up)
