"""qk_norm_rope(q[T,Hq,D], k[T,Hkv,D], v[T,Hkv,D], q_weight[D], k_weight[D], cos[T,D],
sin[T,D], eps, k_cache[P,page,Hkv,D], v_cache[P,page,Hkv,D], slots[T])
-> (q_out[T,Hq,D], k_cache, v_cache)

Sliding-window layers: per-head RMSNorm of q and k (each with its own weight), rounded to BF16
*before* RoPE; then neox half-split RoPE over the full head dim in FP32 with two separate
products and no FMA: out = bf( f32( f32(x*cos) + f32(rot(x)*sin) ) ) (docs/numerics.md).
`cos`/`sin` are FP32 tables from `rope_tables`, computed on the device that runs the model and
shared by all sliding-window layers of a step. V has no norm.

The op also writes the layer's KV cache (model/ops/_paged.py): the normed, rotated K of token t
and its V (bit copies) go to slot `slots[t]` of `k_cache`/`v_cache`, which are updated in place
and returned as outputs 1 and 2 (`INPLACE`), so the verifier compares the whole cache, written
slots and untouched ones. Attention then reads K and V from the cache only.
"""

from __future__ import annotations

import torch

from ._contract import Cost, Numerics, Shape, gen, norm_weight, randn
from ._paged import DEFAULT_PAGE, cache_bytes, cache_inputs, write_kv
from .rmsnorm import reference as rmsnorm

NAME = "qk_norm_rope"
SIGNATURE = (
    "qk_norm_rope(q[T,Hq,D] bf16, k[T,Hkv,D] bf16, v[T,Hkv,D] bf16, q_weight[D] bf16, "
    "k_weight[D] bf16, cos[T,D] fp32, sin[T,D] fp32, eps: float, "
    "k_cache[P,page,Hkv,D] bf16, v_cache[P,page,Hkv,D] bf16, slots[T] int64) "
    "-> (q[T,Hq,D] bf16, k_cache, v_cache)"
)
AXES = {"T": "tokens (varies)", "Hq": "query heads/rank", "Hkv": "KV heads/rank", "D": "head_dim",
        "page": "KV cache page size", "P": "pages in the layer's cache (varies)"}
# Outputs that are inputs updated in place: output index -> argument name.
INPLACE = {1: "k_cache", 2: "v_cache"}
# Test shapes (model/ops/_contract.py "Test shapes"); pages of 4 so writes cross page edges.
CPU_DIMS = {"Hq": 6, "Hkv": 1, "D": 128, "page": 4}
FREE_DIMS = {"Hq": (1, 12)}  # Hkv = 1: any Hq is a whole GQA group
EDGE_SCALES = {"tiny": {0: 2.0**-40, 1: 2.0**-40}, "huge": {0: 2.0**40, 1: 2.0**40}}


def inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """FP32 inverse frequencies, computed on the CPU exactly as transformers does at init."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, D] FP32 for integer positions, on the positions' device."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device, torch.float32)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # BF16 x times FP32 tables promotes: two separate FP32 products, an FP32 add, one rounding.
    c, s = cos[:, None, :], sin[:, None, :]
    return ((x * c) + (_rotate_half(x) * s)).to(x.dtype)


def norm_rope(q, k, q_weight, k_weight, cos, sin, eps: float):
    """(q_out, k_out): the norm and RoPE without the cache write."""
    return apply_rope(rmsnorm(q, q_weight, eps), cos, sin), apply_rope(
        rmsnorm(k, k_weight, eps), cos, sin
    )


def reference(q, k, v, q_weight, k_weight, cos, sin, eps: float, k_cache, v_cache, slots):
    q_out, k_out = norm_rope(q, k, q_weight, k_weight, cos, sin, eps)
    write_kv(k_cache, v_cache, slots, k_out, v)
    return q_out, k_cache, v_cache


def _with_write(fn):
    # A near miss of the norm/RoPE math, written to the cache as the reference writes.
    def near(q, k, v, q_weight, k_weight, cos, sin, eps, k_cache, v_cache, slots):
        q_out, k_out = fn(q, k, q_weight, k_weight, cos, sin, eps)
        write_kv(k_cache, v_cache, slots, k_out, v)
        return q_out, k_cache, v_cache

    return near


def _rope_on_unrounded_norm(q, k, q_weight, k_weight, cos, sin, eps):
    # Near miss: the normed q/k stay FP32 into RoPE (drops the rounding before RoPE).
    def one(x, w):
        xf = x.float()
        n = w.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))
        return ((n * cos[:, None]) + (_rotate_half(n) * sin[:, None])).to(x.dtype)

    return one(q, q_weight), one(k, k_weight)


def _fma_rope(q, k, q_weight, k_weight, cos, sin, eps):
    # Near miss: x*cos + rot(x)*sin evaluated in FP64 then rounded (stands in for an FMA).
    def one(x, w):
        n = rmsnorm(x, w, eps).double()
        out = n * cos[:, None].double() + _rotate_half(n) * sin[:, None].double()
        return out.float().to(x.dtype)

    return one(q, q_weight), one(k, k_weight)


def magnitude(q, k, v, q_weight, k_weight, cos, sin, eps, k_cache, v_cache, slots):
    """Per output, FP32 |n * cos| + |rot(n) * sin|: the size of the two RoPE products, which
    cancel (a near-zero output moves by many of its own ulps when a normed value flips by one);
    zero where the cache is not written (those slots are judged at their own scale)."""
    def terms(x, w):
        n = rmsnorm(x, w, eps).float()
        return n.abs() * cos.abs()[:, None] + _rotate_half(n).abs() * sin.abs()[:, None]

    kc = torch.zeros(k_cache.shape, dtype=torch.float32, device=k_cache.device)
    kc.view(-1, *kc.shape[2:])[slots] = terms(k, k_weight)
    return terms(q, q_weight), kc, torch.zeros_like(kc)


NUMERICS = Numerics(
    kind="ulp",
    # The head_dim=128 norm reduction order may differ; RoPE itself is elementwise, but a 1-ulp
    # flip of the BF16-rounded normed q/k feeds two products and a cancelling sum, which can
    # land 2 ulps from the reference on rare elements: counted at the products' scale.
    max_ulp=2,
    magnitude=magnitude,
    max_mismatch_fraction=1e-3,
    near_misses={"rope_on_unrounded_norm": _with_write(_rope_on_unrounded_norm),
                 "fma_rope": _with_write(_fma_rope)},
)


def make_inputs(shape: Shape, seed: int, device="cpu", dtype=torch.bfloat16) -> tuple:
    g = gen(seed)
    t, hq, hkv, d = shape["T"], shape["Hq"], shape["Hkv"], shape["D"]
    q = randn((t, hq, d), g, dtype, device, scale=2.0)
    k = randn((t, hkv, d), g, dtype, device, scale=2.0)
    # Positions anywhere up to 1M: decode tokens sit deep in long contexts.
    start = int(torch.randint(0, 1_000_000 - t, (1,), generator=g))
    positions = torch.arange(start, start + t, device=device)
    cos, sin = rope_tables(positions, inv_freq(d, shape.get("theta", 10000.0)))
    qw, kw = norm_weight(d, g, dtype, device), norm_weight(d, g, dtype, device)
    v = randn((t, hkv, d), g, dtype, device)
    k_cache, v_cache, slots = cache_inputs(shape, g, dtype, device)
    return q, k, v, qw, kw, cos, sin, 1e-6, k_cache, v_cache, slots


def cost(shape: Shape) -> Cost:
    t, hq, hkv, d = shape["T"], shape["Hq"], shape["Hkv"], shape["D"]
    n = t * (hq + hkv) * d
    # q and k read and q written, the FP32 tables, then the cache write (k out, v through).
    return Cost(bytes=2 * (2 * t * hq * d + t * hkv * d) + 2 * 4 * t * d + cache_bytes(shape),
                flops=10 * n)


def shapes_for(cfg, tokens: int, shard=None, page_size: int = DEFAULT_PAGE) -> dict[str, int]:
    hq = shard.num_attention_heads if shard else cfg.num_attention_heads
    hkv = shard.num_key_value_heads if shard else cfg.num_key_value_heads
    return {"T": tokens, "Hq": hq, "Hkv": hkv, "D": cfg.head_dim, "page": page_size}
