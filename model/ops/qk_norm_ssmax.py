"""qk_norm_ssmax(q[T,Hq,D], k[T,Hkv,D], v[T,Hkv,D], q_weight[D], k_weight[D], positions[T], eps,
k_cache[P,page,Hkv,D], v_cache[P,page,Hkv,D], slots[T]) -> (q_out[T,Hq,D], k_cache, v_cache)

Full-attention (NoPE) layers: per-head RMSNorm of q and k; then scalable softmax scales q only:
    tau = exp(0.1 * log1p((pos + 1) / 2048))   FP32, pos 0-based
    q   = bf(f32(bf(q_normed)) * tau)
Attention still uses scale 1/sqrt(head_dim); tau is not folded into it (docs/numerics.md). On the
GPU a pow-based tau differs from exp/log1p in a third of the FP32 values; on the CPU the two agree
after BF16 rounding, so pow is not usable as a near miss there.

Like `qk_norm_rope`, the op writes the layer's KV cache (model/ops/_paged.py): the normed K of
token t and its V go to slot `slots[t]`; the caches are updated in place and returned as outputs
1 and 2 (`INPLACE`). These layers' attention is then plain causal over the cache, with q already
scaled by tau.
"""

from __future__ import annotations

import math

import torch

from ._contract import Cost, Numerics, Shape, gen, norm_weight, randn
from ._paged import DEFAULT_PAGE, cache_bytes, cache_inputs, write_kv
from .rmsnorm import reference as rmsnorm

NAME = "qk_norm_ssmax"
SIGNATURE = (
    "qk_norm_ssmax(q[T,Hq,D] bf16, k[T,Hkv,D] bf16, v[T,Hkv,D] bf16, q_weight[D] bf16, "
    "k_weight[D] bf16, positions[T] int64, eps: float, k_cache[P,page,Hkv,D] bf16, "
    "v_cache[P,page,Hkv,D] bf16, slots[T] int64) -> (q[T,Hq,D] bf16, k_cache, v_cache)"
)
AXES = {"T": "tokens (varies)", "Hq": "query heads/rank", "Hkv": "KV heads/rank", "D": "head_dim",
        "page": "KV cache page size", "P": "pages in the layer's cache (varies)"}
# Outputs that are inputs updated in place: output index -> argument name.
INPLACE = {1: "k_cache", 2: "v_cache"}
# Test shapes (model/ops/_contract.py "Test shapes"); pages of 4 so writes cross page edges.
CPU_DIMS = {"Hq": 6, "Hkv": 1, "D": 128, "page": 4}
FREE_DIMS = {"Hq": (1, 12)}  # Hkv = 1: any Hq is a whole GQA group
EDGE_SCALES = {"tiny": {0: 2.0**-40, 1: 2.0**-40}, "huge": {0: 2.0**40, 1: 2.0**40}}


def ssmax_scale(positions: torch.Tensor) -> torch.Tensor:
    """FP32 [T] query scale; exp/log1p, not pow (pow differs in a third of the values)."""
    return torch.exp(0.1 * torch.log1p((positions.float() + 1) / 2048))


def norm_ssmax(q, k, q_weight, k_weight, positions, eps: float):
    """(q_out, k_out): the norms and the query scale without the cache write."""
    qn = rmsnorm(q, q_weight, eps)
    tau = ssmax_scale(positions)[:, None, None]
    return (qn.float() * tau).to(q.dtype), rmsnorm(k, k_weight, eps)


def reference(q, k, v, q_weight, k_weight, positions, eps: float, k_cache, v_cache, slots):
    q_out, k_out = norm_ssmax(q, k, q_weight, k_weight, positions, eps)
    write_kv(k_cache, v_cache, slots, k_out, v)
    return q_out, k_cache, v_cache


def _with_write(fn):
    # A near miss of the norm/scale math, written to the cache as the reference writes.
    def near(q, k, v, q_weight, k_weight, positions, eps, k_cache, v_cache, slots):
        q_out, k_out = fn(q, k, q_weight, k_weight, positions, eps)
        write_kv(k_cache, v_cache, slots, k_out, v)
        return q_out, k_cache, v_cache

    return near


# An honest exp/log1p may put tau an ulp or two off torch's (the interpreter's numpy, another
# libm). A zero-based position moves it by 0.1 / (pos + 2049) relative, about 840k / (pos + 2049)
# FP32 ulps: hundreds near the start, one or two near 1M. A tau off the same way rounds a subset
# of the elements the near miss rounds the other way, in proportion to its share of the shift:
# where the shift is libm-sized (beyond ~150k) an honest tau can be the zero-based one and round
# every one of them as the near miss does; from 8 ulps on, libm's 2 make at most a quarter.
ZERO_BASED_MIN_ULPS = 8


def _zero_based_position(q, k, q_weight, k_weight, positions, eps):
    # Near miss: tau from the 0-based position (pos / 2048 instead of (pos + 1) / 2048), at the
    # tokens where that tau is ZERO_BASED_MIN_ULPS or more from the reference's (beyond libm's
    # spread); the reference's tau elsewhere, where the two cannot be told apart.
    tau, zero = ssmax_scale(positions), ssmax_scale(positions - 1)
    apart = (tau.view(torch.int32) - zero.view(torch.int32)).abs() >= ZERO_BASED_MIN_ULPS
    return norm_ssmax(q, k, q_weight, k_weight, torch.where(apart, positions - 1, positions), eps)


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
        "zero_based_position": _with_write(_zero_based_position),
        "scale_unrounded_norm": _with_write(_scale_unrounded_norm),
    },
)


def make_inputs(shape: Shape, seed: int, device="cpu", dtype=torch.bfloat16) -> tuple:
    g = gen(seed)
    t, hq, hkv, d = shape["T"], shape["Hq"], shape["Hkv"], shape["D"]
    q = randn((t, hq, d), g, dtype, device, scale=2.0)
    k = randn((t, hkv, d), g, dtype, device, scale=2.0)
    # The first position is log-uniform over [0, 1M): the zero-based-position near miss stands
    # out of libm's spread below ~150k (ZERO_BASED_MIN_ULPS), where most draws start, and the
    # others still cover long contexts.
    u = float(torch.rand((1,), generator=g, dtype=torch.float64))
    start = min(int(math.exp(u * math.log(1_000_000 - t))) - 1, 1_000_000 - t - 1)
    positions = torch.arange(start, start + t, device=device)
    qw, kw = norm_weight(d, g, dtype, device), norm_weight(d, g, dtype, device)
    v = randn((t, hkv, d), g, dtype, device)
    k_cache, v_cache, slots = cache_inputs(shape, g, dtype, device)
    return q, k, v, qw, kw, positions, 1e-6, k_cache, v_cache, slots


def cost(shape: Shape) -> Cost:
    t, hq, hkv, d = shape["T"], shape["Hq"], shape["Hkv"], shape["D"]
    n = t * (hq + hkv) * d
    # q and k read, q written, the positions, then the cache write (k out, v through).
    return Cost(bytes=2 * (2 * t * hq * d + t * hkv * d) + 8 * t + cache_bytes(shape),
                flops=6 * n)


def shapes_for(cfg, tokens: int, shard=None, page_size: int = DEFAULT_PAGE) -> dict[str, int]:
    hq = shard.num_attention_heads if shard else cfg.num_attention_heads
    hkv = shard.num_key_value_heads if shard else cfg.num_key_value_heads
    return {"T": tokens, "Hq": hq, "Hkv": hkv, "D": cfg.head_dim, "page": page_size}
