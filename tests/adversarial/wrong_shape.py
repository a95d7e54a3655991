"""Broken: returns RMSNorm flattened to one dimension. Expected: "wrong dtype/shape"."""

from __future__ import annotations

import torch


def run(x, weight, eps, config=None):
    xf = x.float()
    y = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))
    return y.to(x.dtype).flatten()
