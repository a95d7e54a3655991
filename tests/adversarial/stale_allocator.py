"""Cheat: returns uninitialised memory, hoping the allocator hands back the block where the
harness just computed the reference's output. Expected: "not written (NaN poison survived)"."""

from __future__ import annotations

import torch


def run(gate, up, config=None):
    return torch.empty_like(gate)
