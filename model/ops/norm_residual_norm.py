"""norm_residual_norm(branch[T,H], residual[T,H], post_weight[H], next_weight[H], add_index, eps)
-> (normed_next[T,H], new_residual[T,H])

The sandwich-norm boundary after every attention and MLP sublayer (104 per forward):
    p  = bf(RMSNorm_post(branch))
    h' = bf( f32(bf(f32(p)*a)) + f32(bf(f32(h)*b)) )   a = 1/sqrt(d), b = sqrt((d-1)/d)
    n  = bf(RMSNorm_next(h'))
with d = add_index = 2(L+1) after attention and 2(L+1)+1 after the MLP (docs/numerics.md). The
residual stream is BF16.
"""

from __future__ import annotations

import math

import torch

from ._contract import BIASED_ROW_SUMS, Cost, Numerics, Shape, gen, norm_weight, randn
from .rmsnorm import reference as rmsnorm

NAME = "norm_residual_norm"
SIGNATURE = (
    "norm_residual_norm(branch[T,H] bf16, residual[T,H] bf16, post_weight[H] bf16, "
    "next_weight[H] bf16, add_index: int, eps: float) -> (normed_next[T,H], new_residual[T,H])"
)
AXES = {"T": "tokens (varies)", "H": "hidden size (config)", "add_index": "2..105 (depth)"}
# Test shapes (model/ops/_contract.py "Test shapes").
CPU_DIMS = {"H": 320}
FREE_DIMS = {"H": (8, 640)}
# Every depth index once, on one row: a kernel exact at the depths a random draw hits and off at
# one (the last layer's, say) would otherwise pass most verifications.
EDGE_SHAPES = {f"add_index={d}": {"T": 1, "add_index": d} for d in range(2, 106)}
TOKEN_RANGE = {"cpu": (1, 192)}
EDGE_SCALES = {"tiny": {0: 2.0**-40, 1: 2.0**-40}, "huge": {0: 2.0**40, 1: 2.0**40}}


def residual_scales(add_index: int) -> tuple[float, float]:
    """(branch scale a, residual scale b) for the n-th residual add, as Python floats."""
    return 1.0 / math.sqrt(add_index), math.sqrt((add_index - 1) / add_index)


def depth_scaled_add(branch: torch.Tensor, residual: torch.Tensor, add_index: int) -> torch.Tensor:
    a, b = residual_scales(add_index)
    # Each product is a BF16 tensor times a Python float: bf(f32(x) * f32(c)); then a BF16 add.
    return branch * a + residual * b


def reference(branch, residual, post_weight, next_weight, add_index: int, eps: float):
    p = rmsnorm(branch, post_weight, eps)
    h = depth_scaled_add(p, residual, add_index)
    return rmsnorm(h, next_weight, eps), h


def magnitude(branch, residual, post_weight, next_weight, add_index: int, eps: float):
    """(normed_next, new_residual) error scales, FP32: ulps of new_residual are counted at the
    size of the two terms it adds, max(|bf(p*a)|, |bf(h*b)|), and those of normed_next at twice
    that size times the next norm's row scale and weight. The terms cancel in places: where
    bf(p*a) ~ -bf(h*b) the sum is tiny, and p off by one ulp (its RMS summed in another order)
    moves it by many of its own ulps (a one-pass kernel on an H200: 12 of 10M outputs at T=2048
    by up to 32 ulp, and the next norm carries them into normed_next) but by at most one ulp
    of the terms, as in `moe_experts`' combine."""
    a, b = residual_scales(add_index)
    p = rmsnorm(branch, post_weight, eps)
    terms = torch.maximum((p * a).float().abs(), (residual * b).float().abs())
    h = depth_scaled_add(p, residual, add_index).float()
    row = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    # Twice: an ulp of the terms times the row scale and weight spans up to two ulps of their
    # product (the binades do not line up).
    return 2.0 * terms * row * next_weight.float().abs(), terms


def _fp32_residual_add(branch, residual, post_weight, next_weight, add_index, eps):
    # Near miss: keep the scaled operands in FP32 and round the sum once.
    a, b = residual_scales(add_index)
    p = rmsnorm(branch, post_weight, eps)
    h = (p.float() * a + residual.float() * b).to(branch.dtype)
    return rmsnorm(h, next_weight, eps), h


def _unrounded_branch_product(branch, residual, post_weight, next_weight, add_index, eps):
    # Near miss: the branch product stays FP32 (as in an FMA into the rounded residual product).
    a, b = residual_scales(add_index)
    p = rmsnorm(branch, post_weight, eps)
    rb = (residual.float() * b).to(branch.dtype).float()
    h = (rb + p.float() * a).to(branch.dtype)
    return rmsnorm(h, next_weight, eps), h


def _next_norm_on_unrounded(branch, residual, post_weight, next_weight, add_index, eps):
    # Near miss: feed the FP32 sum (before its BF16 rounding) into the next norm.
    a, b = residual_scales(add_index)
    p = rmsnorm(branch, post_weight, eps)
    hf = (p * a).float() + (residual * b).float()
    return rmsnorm(hf, next_weight, eps).to(branch.dtype), hf.to(branch.dtype)


NUMERICS = Numerics(
    kind="ulp",
    # Ulps at the terms' scale (`magnitude`): the normed branch one ulp off (its RMS summed in
    # another order) moves bf(p*a) by an ulp and the rounded sum by up to two, and the next norm
    # carries that into normed_next with one more rounding: up to three. On an H200 a one-pass
    # kernel had, counted at the terms' scale without the factor 2, 13 of 10M outputs at 3 and
    # 7 at 2 (T = 2048), the rest at most 1 (tests/test_numerics_scales.py simulates the worst).
    max_ulp=3,
    # Two hidden-size reductions; a different reduction order moves ~1e-6 of outputs by 1 ulp.
    max_mismatch_fraction=1e-3,
    near_misses={
        "fp32_residual_add": _fp32_residual_add,
        "unrounded_branch_product": _unrounded_branch_product,
        "next_norm_on_unrounded": _next_norm_on_unrounded,
    },
    magnitude=magnitude,
    judge_bias=False,
    note=("ulps at the scale of the residual add's terms (`magnitude`): the add cancels in "
          "places, and a one-ulp change of the normed branch moves a cancelled sum by many of "
          "its own ulps. " + BIASED_ROW_SUMS),
)


def make_inputs(shape: Shape, seed: int, device="cpu", dtype=torch.bfloat16) -> tuple:
    g = gen(seed)
    t, h = shape["T"], shape["H"]
    branch = randn((t, h), g, dtype, device, scale=3.0)
    residual = randn((t, h), g, dtype, device, scale=1.0)
    add_index = int(shape.get("add_index", 2 + int(torch.randint(0, 104, (1,), generator=g))))
    return (
        branch,
        residual,
        norm_weight(h, g, dtype, device),
        norm_weight(h, g, dtype, device),
        add_index,
        1e-6,
    )


def cost(shape: Shape) -> Cost:
    t, h = shape["T"], shape["H"]
    return Cost(bytes=2 * (4 * t * h + 2 * h), flops=12 * t * h)


def shapes_for(cfg, tokens: int, shard=None) -> dict[str, int]:
    return {"T": tokens, "H": cfg.hidden_size}
