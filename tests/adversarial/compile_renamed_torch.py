"""Cheat: hands the op to torch.compile imported under another name (a baseline, not a kernel).
Expected: "static screen: uses torch.compile"."""

from __future__ import annotations

import torch.nn.functional as F
from torch import compile as accelerate


@accelerate
def _swiglu(gate, up):
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def run(gate, up, config=None):
    return _swiglu(gate, up)
