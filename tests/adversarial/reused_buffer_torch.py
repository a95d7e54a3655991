"""Cheat (outputs that do not stay put): returns a module-level buffer per shape that the next
call at that shape overwrites (no allocation per call).
Expected: "outputs changed after later calls", or wrong outputs in the burst."""

from __future__ import annotations

import torch
import torch.nn.functional as F

_OUT = {}


def run(gate, up, config=None):
    key = tuple(gate.shape)
    if key not in _OUT:
        _OUT[key] = torch.empty_like(gate)
    return _OUT[key].copy_((F.silu(gate.float()) * up.float()).to(gate.dtype))
