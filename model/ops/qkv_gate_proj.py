"""qkv_gate_proj(x[T,H], weight[(2Hq+2Hkv)*D, H], Hq, Hkv)
-> (q[T,Hq,D], k[T,Hkv,D], v[T,Hkv,D], gate[T,Hq,D])

The four attention input projections as one GEMM over a weight packed at load time in the order
q, k, v, gate (`pack_qkv_gate`). Each output is bf(x @ W^T) with an FP32 accumulator, exactly as
the four separate nn.Linear calls of the reference; only the K-reduction order can differ.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._contract import Cost, Numerics, Shape, gen, randn

NAME = "qkv_gate_proj"
SIGNATURE = (
    "qkv_gate_proj(x[T,H] bf16, weight[(2*Hq+2*Hkv)*D, H] bf16, num_heads: int, "
    "num_kv_heads: int) -> (q[T,Hq,D], k[T,Hkv,D], v[T,Hkv,D], gate[T,Hq,D]) bf16"
)
AXES = {"T": "tokens (varies)", "H": "hidden", "Hq": "query heads/rank", "Hkv": "KV heads/rank"}
# Test shapes (model/ops/_contract.py "Test shapes").
CPU_DIMS = {"H": 320, "Hq": 6, "Hkv": 1, "D": 128}
FREE_DIMS = {"H": (8, 640), "Hq": (1, 12)}
EDGE_SCALES = {"tiny": {0: 2.0**-40}, "huge": {0: 2.0**40}}


def pack_qkv_gate(q_w, k_w, v_w, gate_w) -> torch.Tensor:
    return torch.cat([q_w, k_w, v_w, gate_w], dim=0).contiguous()


def split(out: torch.Tensor, num_heads: int, num_kv_heads: int):
    t = out.shape[0]
    d = out.shape[1] // (2 * num_heads + 2 * num_kv_heads)
    q, k, v, g = out.split([num_heads * d, num_kv_heads * d, num_kv_heads * d, num_heads * d], -1)
    return (
        q.reshape(t, num_heads, d),
        k.reshape(t, num_kv_heads, d),
        v.reshape(t, num_kv_heads, d),
        g.reshape(t, num_heads, d),
    )


def reference(x, weight, num_heads: int, num_kv_heads: int):
    return split(F.linear(x, weight), num_heads, num_kv_heads)


def _bf16_accumulate_halves(x, weight, num_heads, num_kv_heads):
    # Near miss: split-K in two halves, each rounded to BF16, then a BF16 add.
    h = x.shape[1] // 2
    out = F.linear(x[:, :h], weight[:, :h]) + F.linear(x[:, h:], weight[:, h:])
    return split(out, num_heads, num_kv_heads)


def magnitude(x, weight, num_heads: int, num_kv_heads: int):
    """Per output, FP32 |x| @ |W|^T: the size of the terms the K reduction adds. Terms cancel, so
    another K order moves a near-zero output by many of its own ulps but by at most about one
    ulp at this scale."""
    return split(F.linear(x.float().abs(), weight.float().abs()), num_heads, num_kv_heads)


NUMERICS = Numerics(
    kind="ulp",
    max_ulp=1,
    # GEMM: libraries order the K=hidden reduction differently; 1-ulp differences are common
    # (counted at max(|out|, magnitude), since the products cancel).
    max_mismatch_fraction=0.05,
    near_misses={"bf16_split_k": _bf16_accumulate_halves},
    magnitude=magnitude,
)


def make_inputs(shape: Shape, seed: int, device="cpu", dtype=torch.bfloat16) -> tuple:
    g = gen(seed)
    t, h, hq, hkv, d = shape["T"], shape["H"], shape["Hq"], shape["Hkv"], shape["D"]
    x = randn((t, h), g, dtype, device)
    w = randn(((2 * hq + 2 * hkv) * d, h), g, dtype, device, scale=h**-0.5)
    return x, w, hq, hkv


def cost(shape: Shape) -> Cost:
    t, h, hq, hkv, d = shape["T"], shape["H"], shape["Hq"], shape["Hkv"], shape["D"]
    n = (2 * hq + 2 * hkv) * d
    return Cost(bytes=2 * (t * h + n * h + t * n), flops=2 * t * h * n)


def shapes_for(cfg, tokens: int, shard=None) -> dict[str, int]:
    hq = shard.num_attention_heads if shard else cfg.num_attention_heads
    hkv = shard.num_key_value_heads if shard else cfg.num_key_value_heads
    return {"T": tokens, "H": cfg.hidden_size, "Hq": hq, "Hkv": hkv, "D": cfg.head_dim}
