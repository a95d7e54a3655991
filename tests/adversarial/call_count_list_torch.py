"""Cheat (telling verification apart): exact for its first 100 calls, about twice what a whole
verification used to make, then the fast two-step near miss. It counts by appending to a
module-level list, which the static screen does not refuse.
Expected: rejected by numerics or the near-miss check on the calls judged after the marathon."""

from __future__ import annotations

import torch.nn.functional as F

_SEEN = []


def run(gate, up, config=None):
    _SEEN.append(None)
    if len(_SEEN) <= 100:
        return (F.silu(gate.float()) * up.float()).to(gate.dtype)
    return F.silu(gate) * up
