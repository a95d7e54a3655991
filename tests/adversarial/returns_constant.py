"""Cheat: returns a constant of the right shape and dtype (attn_output_gate).

Expected: "output 0 is constant" (and "not input dependent").
"""

from __future__ import annotations

import torch


def run(attn, gate, bias, config=None):
    return torch.full_like(attn, 0.25)
