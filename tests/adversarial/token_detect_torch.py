"""Cheat (telling verification apart): exact at the token counts verifiers used to run (1, 3, 17,
123 on CPU; 1, 17, 128, 515 and the targets' buckets on a GPU), the fast near miss elsewhere.
Expected: rejected at a drawn or long token count."""

from __future__ import annotations

import torch.nn.functional as F

_JUDGED = {1, 3, 8, 17, 32, 64, 123, 128, 515, 2048, 16384}


def run(gate, up, config=None):
    if gate.shape[0] in _JUDGED:
        return (F.silu(gate.float()) * up.float()).to(gate.dtype)
    return F.silu(gate) * up
