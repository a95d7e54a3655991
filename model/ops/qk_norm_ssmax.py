"""qk_norm_ssmax(q[T,Hq,D], k[T,Hkv,D], q_weight[D], k_weight[D], positions[T], eps)
-> (q_out[T,Hq,D], k_out[T,Hkv,D])

Full-attention (NoPE) layers: per-head RMSNorm of q and k; then scalable softmax scales q only:
    tau = exp(0.1 * log1p((pos + 1) / 2048))   FP32, pos 0-based
    q   = bf(f32(bf(q_normed)) * tau)
Attention still uses scale 1/sqrt(head_dim); tau is not folded into it (NUMERICS.md). On the GPU
a pow-based tau differs from exp/log1p in a third of the FP32 values; on the CPU the two agree
after BF16 rounding, so pow is not usable as a near miss there.
"""

from __future__ import annotations

import torch

from ._contract import Cost, Numerics, Shape, gen, norm_weight, randn
from .rmsnorm import reference as rmsnorm

NAME = "qk_norm_ssmax"
SIGNATURE = (
    "qk_norm_ssmax(q[T,Hq,D] bf16, k[T,Hkv,D] bf16, q_weight[D] bf16, k_weight[D] bf16, "
    "positions[T] int64, eps: float) -> (q[T,Hq,D], k[T,Hkv,D]) bf16"
)
AXES = {"T": "tokens (varies)", "Hq": "query heads/rank", "Hkv": "KV heads/rank", "D": "head_dim"}
# Test shapes (model/ops/_contract.py "Test shapes").
CPU_DIMS = {"Hq": 6, "Hkv": 1, "D": 128}
CPU_FREE_DIMS = {"Hq": (1, 12)}  # Hkv = 1: any Hq is a whole GQA group
EDGE_SCALES = {"tiny": {0: 2.0**-40, 1: 2.0**-40}, "huge": {0: 2.0**40, 1: 2.0**40}}


def ssmax_scale(positions: torch.Tensor) -> torch.Tensor:
    """FP32 [T] query scale; exp/log1p, not pow (pow differs in a third of the values)."""
    return torch.exp(0.1 * torch.log1p((positions.float() + 1) / 2048))


def reference(q, k, q_weight, k_weight, positions, eps: float):
    qn = rmsnorm(q, q_weight, eps)
    tau = ssmax_scale(positions)[:, None, None]
    return (qn.float() * tau).to(q.dtype), rmsnorm(k, k_weight, eps)


def _zero_based_position(q, k, q_weight, k_weight, positions, eps):
    # Near miss: tau from the 0-based position (pos / 2048 instead of (pos + 1) / 2048).
    return reference(q, k, q_weight, k_weight, positions - 1, eps)


def _scale_unrounded_norm(q, k, q_weight, k_weight, positions, eps):
    # Near miss: tau multiplies the FP32 normed q before its BF16 rounding.
    qf = q.float()
    n = q_weight.float() * (qf * torch.rsqrt(qf.pow(2).mean(-1, keepdim=True) + eps))
    return (n * ssmax_scale(positions)[:, None, None]).to(q.dtype), rmsnorm(k, k_weight, eps)


NUMERICS = Numerics(
    kind="ulp",
    # A 1-ulp flip of the BF16-rounded normed q (another reduction order) times tau rounds
    # again: up to 2 ulps from the reference on rare elements.
    max_ulp=2,
    max_mismatch_fraction=1e-3,
    near_misses={
        "zero_based_position": _zero_based_position,
        "scale_unrounded_norm": _scale_unrounded_norm,
    },
)


def make_inputs(shape: Shape, seed: int, device="cpu", dtype=torch.bfloat16) -> tuple:
    g = gen(seed)
    t, hq, hkv, d = shape["T"], shape["Hq"], shape["Hkv"], shape["D"]
    q = randn((t, hq, d), g, dtype, device, scale=2.0)
    k = randn((t, hkv, d), g, dtype, device, scale=2.0)
    start = int(torch.randint(0, 1_000_000 - t, (1,), generator=g))
    positions = torch.arange(start, start + t, device=device)
    return q, k, norm_weight(d, g, dtype, device), norm_weight(d, g, dtype, device), positions, 1e-6


def cost(shape: Shape) -> Cost:
    t, hq, hkv, d = shape["T"], shape["Hq"], shape["Hkv"], shape["D"]
    n = t * (hq + hkv) * d
    return Cost(bytes=2 * 2 * n + 8 * t, flops=6 * n)


def shapes_for(cfg, tokens: int, shard=None) -> dict[str, int]:
    hq = shard.num_attention_heads if shard else cfg.num_attention_heads
    hkv = shard.num_key_value_heads if shard else cfg.num_key_value_heads
    return {"T": tokens, "Hq": hq, "Hkv": hkv, "D": cfg.head_dim}
