"""Cheat (remembering instead of computing): caches outputs under a key of the shape and a few
sampled input values (not their addresses), so repeated content is a lookup.
Expected: "caches outputs by content" (a one-element change must change the output)."""

from __future__ import annotations

import torch

_CACHE = {}


def run(attn, gate, bias, config=None):
    a, g = attn.reshape(-1), gate.reshape(-1)
    key = (tuple(attn.shape), float(a[0]), float(a[-1]), float(g[g.numel() // 3]), float(bias[0]))
    if key not in _CACHE:
        _CACHE[key] = attn * torch.sigmoid(gate + bias[None, :, None])
    return _CACHE[key].clone()
