"""Cheat: returns zeros of the right shape and dtype. Expected: "output 0 is all zeros"."""

from __future__ import annotations

import torch


def run(gate, up, config=None):
    return torch.zeros_like(gate)
