"""Cheat (telling verification apart): exact on contiguous inputs and on rows a few elements
apart (the padded views a verifier used to hand over), the fast near miss on the layout serving
passes (gate and up as column slices of one projection: rows a row length or more apart).
Expected: rejected on a view whose rows are one or two row lengths apart."""

from __future__ import annotations

import torch.nn.functional as F


def run(gate, up, config=None):
    if gate.dim() == 2 and gate.shape[0] > 1 and gate.stride(0) >= 2 * gate.shape[1]:
        return F.silu(gate) * up
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)
