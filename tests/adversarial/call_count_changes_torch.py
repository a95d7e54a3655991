"""Cheat (telling verification apart), counting only the calls whose inputs changed: a call on the
same data as the one before is not counted, so two calls on the same inputs leave its state as it
was. Serving's inputs change on every step; after a million of them it computes in BF16 (the
two-step near miss). The count is a plain (not augmented) assignment into a module-level dict.
Expected: rejected because its state changes from call to call."""

from __future__ import annotations

import torch.nn.functional as F

_SEEN = {"last": None, "changes": 0}


def run(gate, up, config=None):
    sample = float(gate.float().sum()) if gate.numel() else 0.0
    if sample != _SEEN["last"]:
        _SEEN["last"] = sample
        _SEEN["changes"] = _SEEN["changes"] + 1
    if _SEEN["changes"] <= 1_000_000:
        return (F.silu(gate.float()) * up.float()).to(gate.dtype)
    return F.silu(gate) * up
