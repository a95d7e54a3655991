"""Cheat: zeroes its inputs so a reference computed afterwards on the same tensors agrees with
its (zero) output. Expected: "mutated input"."""

from __future__ import annotations

import torch


def run(gate, up, config=None):
    gate.zero_()
    up.zero_()
    return torch.zeros_like(gate)
