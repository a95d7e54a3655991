"""rmsnorm(x[T,H], weight[H], eps) -> [T,H]

y = bf( f32(w) * ( f32(x) * rsqrt(mean(f32(x)^2) + eps) ) ): the weight multiplies after the
normalisation, in FP32, and the result is rounded once (docs/numerics.md "RMSNorm").
Used for the first pre-norm and for the per-head Q/K norms (H = head_dim there).
"""

from __future__ import annotations

import torch

from ._contract import BIASED_ROW_SUMS, Cost, Numerics, Shape, gen, norm_weight, randn

NAME = "rmsnorm"
SIGNATURE = "rmsnorm(x[T,H] bf16, weight[H] bf16, eps: float) -> [T,H] bf16"
AXES = {"T": "tokens (varies)", "H": "hidden size (config)"}
# Test shapes (model/ops/_contract.py "Test shapes").
CPU_DIMS = {"H": 320}
FREE_DIMS = {"H": (8, 1024)}
# Tiny rows make eps matter (mean(x^2) far below it); huge ones test an FP32 square.
EDGE_SCALES = {"tiny": {0: 2.0**-40}, "huge": {0: 2.0**40}}


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    variance = xf.pow(2).mean(-1, keepdim=True)
    return (weight * (xf * torch.rsqrt(variance + eps))).to(x.dtype)


def _weight_in_input_dtype(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Near miss: round the normalised x to BF16 before the weight multiplies (two roundings).
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed).to(x.dtype)


def _one_plus_weight(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Near miss: the Gemma-style (1 + w) scaling that Beam does not use.
    return reference(x, weight.float() + 1.0, eps)


NUMERICS = Numerics(
    kind="ulp",
    max_ulp=1,
    # A plain tl.sum reduction differs from torch's in ~2 per million outputs (docs/numerics.md).
    max_mismatch_fraction=1e-3,
    near_misses={
        "round_before_weight": _weight_in_input_dtype,
        "one_plus_weight": _one_plus_weight,
    },
    judge_bias=False,
    note=BIASED_ROW_SUMS,
)


def make_inputs(shape: Shape, seed: int, device="cpu", dtype=torch.bfloat16) -> tuple:
    g = gen(seed)
    x = randn((shape["T"], shape["H"]), g, dtype, device, scale=1.5)
    return x, norm_weight(shape["H"], g, dtype, device), 1e-6


def cost(shape: Shape) -> Cost:
    t, h = shape["T"], shape["H"]
    return Cost(bytes=2 * (2 * t * h + h), flops=4 * t * h)


def shapes_for(cfg, tokens: int, shard=None) -> dict[str, int]:
    return {"T": tokens, "H": cfg.hidden_size}
