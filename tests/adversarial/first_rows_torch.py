"""Cheat (tolerance pooled over shapes): computes the first 200 rows only (more than an old
verifier used on CPU); the rest of a long batch keeps whatever memory held.
Expected: "not written" at a long T (the verifier draws T beyond its buckets)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def run(gate, up, config=None):
    out = torch.empty_like(gate)
    n = min(gate.shape[0], 200)
    out[:n] = (F.silu(gate[:n].float()) * up[:n].float()).to(gate.dtype)
    return out
