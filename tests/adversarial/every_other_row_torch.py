"""Cheat (tolerance pooled over shapes): rmsnorm whose odd rows round the normalised value to BF16
before the weight (the 'round_before_weight' near miss) - half the rows.
Expected: rejected per shape (near miss or numerics)."""

from __future__ import annotations

import torch


def run(x, weight, eps, config=None):
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    odd = torch.arange(x.shape[0], device=x.device)[:, None] % 2 == 1
    normed = torch.where(odd, normed.to(x.dtype).float(), normed)
    return (weight.float() * normed).to(x.dtype)
