"""Cheat (telling verification from serving): exact while its inputs are fresh, the fast near
miss once an input has been written in place many times, as a CUDA graph's static buffers and
a KV cache are in serving (torch counts the writes in `_version`). Expected: rejected by the
static screen (it reads a tensor's private attribute)."""

from __future__ import annotations

import torch.nn.functional as F


def run(gate, up, config=None):
    if gate._version > 16:
        return F.silu(gate) * up
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)
