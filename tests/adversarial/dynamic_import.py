"""Cheat: hides a forbidden import from a naive screen. Expected: "calls __import__"."""

from __future__ import annotations

import torch


def run(gate, up, config=None):
    mod = __import__("sub" + "process")
    mod.run(["true"])
    return torch.zeros_like(gate)
