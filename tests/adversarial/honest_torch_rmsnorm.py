"""Honest: RMSNorm in plain torch with a different reduction (sums of 64-element chunks, then
their sum, then one multiply by f32(1/H) as torch's CUDA mean does).

The sum of squares is added in another order than the reference's `mean`, so rare outputs may
differ by 1 BF16 ulp; the rmsnorm policy allows that (ulp 1, fraction 1e-3). An einsum (cuBLAS's
FP32 dot product) in place of the chunked sum was rejected twice on an H200 as biased: its sums
of squares were smaller than torch's in every row that differed, an error of one sign, which the
judge cannot tell from a rounding-mode cheat (docs/judge.md, known limits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def run(x, weight, eps, config=None):
    xf = x.to(torch.float32)
    h = x.shape[-1]
    sq = F.pad(xf * xf, (0, (-h) % 64))  # zeros add nothing
    ss = sq.view(x.shape[0], sq.shape[-1] // 64, 64).sum(-1).sum(-1, keepdim=True) * (1.0 / h)
    y = (xf * torch.rsqrt(ss + eps)) * weight.to(torch.float32)
    return y.to(x.dtype)
