"""Broken: drops the rounding point of swiglu (silu rounded to BF16, then a BF16 product).
Expected: "closer to near miss 'bf16_two_step' than to the reference"."""

from __future__ import annotations

import torch.nn.functional as F


def run(gate, up, config=None):
    return F.silu(gate) * up
