"""Honest: RMSNorm in plain torch with a different reduction (sum then one multiply by 1/H).

The sum of squares is reduced by a different kernel than the reference's `mean`, so rare outputs
may differ by 1 BF16 ulp; the rmsnorm policy allows that (ulp 1, fraction 1e-3).
"""

from __future__ import annotations

import torch


def run(x, weight, eps, config=None):
    xf = x.to(torch.float32)
    ss = torch.einsum("th,th->t", xf, xf)[:, None] * (1.0 / x.shape[-1])
    y = (xf * torch.rsqrt(ss + eps)) * weight.to(torch.float32)
    return y.to(x.dtype)
