"""Cheat (telling verification from serving): exact when its input owns its allocation or sits
in a slightly wider one (the judge's contiguous and row-padded layouts), the fast near miss when
the allocation is four times the input or more, as when a CUDA graph slices its inputs out of
static buffers sized for the largest batch. Expected: rejected on a prefix of a larger
allocation."""

from __future__ import annotations

import torch.nn.functional as F


def run(gate, up, config=None):
    if gate.untyped_storage().nbytes() >= 4 * gate.numel() * gate.element_size():
        return F.silu(gate) * up
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)
