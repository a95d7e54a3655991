"""attn_output_gate(attn[T,Hq,D], gate[T,Hq,D], bias[Hq]) -> [T,Hq,D]

`gate` is the raw gate_proj output. Three rounding points (docs/numerics.md "Output gate"):
    g2 = bf(g + bias[head]);  s = bf(sigmoid_f32(g2));  out = bf(attn * s)
"""

from __future__ import annotations

import torch

from ._contract import Cost, Numerics, Shape, gen, randn

NAME = "attn_output_gate"
SIGNATURE = "attn_output_gate(attn[T,Hq,D] bf16, gate[T,Hq,D] bf16, bias[Hq] bf16) -> [T,Hq,D] bf16"
AXES = {"T": "tokens (varies)", "Hq": "query heads per rank (config/TP)", "D": "head_dim (config)"}
# Test shapes (model/ops/_contract.py "Test shapes").
CPU_DIMS = {"Hq": 6, "D": 128}
FREE_DIMS = {"Hq": (1, 12)}
EDGE_SCALES = {"tiny": {0: 2.0**-60}, "huge": {0: 2.0**60, 1: 2.0**3}}


def reference(attn: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return attn * torch.sigmoid(gate + bias[None, :, None])


def _fp32_gate(attn, gate, bias):
    # Near miss: bias add, sigmoid and product all in FP32, rounded once (a fused shortcut).
    s = torch.sigmoid(gate.float() + bias.float()[None, :, None])
    return (attn.float() * s).to(attn.dtype)


def _unrounded_sigmoid(attn, gate, bias):
    # Near miss: the bias add is rounded but the sigmoid output is not.
    s = torch.sigmoid((gate + bias[None, :, None]).float())
    return (attn.float() * s).to(attn.dtype)


NUMERICS = Numerics(
    kind="bitwise",
    near_misses={"fp32_gate": _fp32_gate, "unrounded_sigmoid": _unrounded_sigmoid},
)


def make_inputs(shape: Shape, seed: int, device="cpu", dtype=torch.bfloat16) -> tuple:
    g = gen(seed)
    t, hq, d = shape["T"], shape["Hq"], shape["D"]
    attn = randn((t, hq, d), g, dtype, device, scale=0.5)
    gate = randn((t, hq, d), g, dtype, device, scale=2.0)
    bias = randn((hq,), g, dtype, device, scale=1.0)
    return attn, gate, bias


def cost(shape: Shape) -> Cost:
    n = shape["T"] * shape["Hq"] * shape["D"]
    return Cost(bytes=2 * (3 * n + shape["Hq"]), flops=6 * n)


def shapes_for(cfg, tokens: int, shard=None) -> dict[str, int]:
    heads = shard.num_attention_heads if shard else cfg.num_attention_heads
    return {"T": tokens, "Hq": heads, "D": cfg.head_dim}
