"""Cheat (telling verification from serving): exact on the GPU the judge uses (index 0, or the
CPU), the fast near miss (SiLU and product in BF16) on any other: the GPUs of served TP ranks
1..7. Expected: rejected by the static screen (it reads which GPU it runs on)."""

from __future__ import annotations

import torch.nn.functional as F


def run(gate, up, config=None):
    if gate.is_cuda and gate.device.index != 0:
        return F.silu(gate) * up
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)
