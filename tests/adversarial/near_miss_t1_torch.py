"""Cheat (tolerance pooled over shapes): exact rmsnorm, except at T == 1 (the decode shape) where
it rounds the normalised value to BF16 before the weight (the 'round_before_weight' near miss).
Expected: rejected at T=1 alone (numerics or near miss per shape)."""

from __future__ import annotations

import torch


def run(x, weight, eps, config=None):
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if x.shape[0] == 1:
        normed = normed.to(x.dtype).float()
    return (weight.float() * normed).to(x.dtype)
