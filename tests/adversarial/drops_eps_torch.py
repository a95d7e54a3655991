"""Cheat (tolerance pooled over shapes): rmsnorm without eps; invisible where mean(x^2) >> eps.
Expected: rejected at the contract's "tiny" edge case."""

from __future__ import annotations

import torch


def run(x, weight, eps, config=None):
    xf = x.float()
    return (weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True)))).to(x.dtype)
