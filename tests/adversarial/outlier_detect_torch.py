"""Cheat (telling verification apart): exact on inputs that look like a verifier's random data
(every value within a few standard deviations of the tensor's own), the fast near miss on
activations like a served model's, where a few channels carry values many times the rest.
Uniformly scaled inputs (the tiny and huge edge cases) keep the ratio and stay exact.
Expected: rejected on inputs with outlier channels."""

from __future__ import annotations

import torch.nn.functional as F


def run(gate, up, config=None):
    g = gate.float()
    if g.numel() > 1 and bool((g.abs() > 7.0 * g.std()).any()):
        return F.silu(gate) * up
    return (F.silu(g) * up.float()).to(gate.dtype)
