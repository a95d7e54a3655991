"""Broken: RMSNorm computed entirely in BF16 (no FP32 accumulation). Expected: "numerics"."""

from __future__ import annotations

import torch


def run(x, weight, eps, config=None):
    var = (x * x).mean(-1, keepdim=True)
    return x * torch.rsqrt(var + eps) * weight
