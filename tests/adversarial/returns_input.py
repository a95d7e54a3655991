"""Cheat: writes the result into its input and returns that tensor (output aliases input 0).
Expected: "output 0 aliases input 0"."""

from __future__ import annotations

import torch.nn.functional as F


def run(gate, up, config=None):
    gate.copy_((F.silu(gate.float()) * up.float()).to(gate.dtype))
    return gate
