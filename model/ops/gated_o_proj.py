"""gated_o_proj(attn[T,Hq,D], gate[T,Hq,D], bias[Hq], weight[H, Hq*D]) -> [T,H]

The output gate and the o_proj GEMM as one boundary (docs/numerics.md "Output gate"):
    a = attn_output_gate(attn, gate, bias)            three BF16 rounding points, bitwise
    out = bf(a[T, Hq*D] @ weight^T)                    FP32 accumulator, one rounding
A fused kernel applies the gate in the GEMM's prologue, so the gated activation never makes a
round trip through memory and the block loses a launch; it must still round the gated value to
BF16 before the product, as the reference does. Only the order of the K = Hq*D reduction may
differ from the library GEMM's. Under TP the output is the rank's row-parallel partial.

A composite op: the model always calls it, and while no registry variant is selected for it the
op table composes it from the table's own `attn_output_gate` (a locked gate kernel keeps
running) and the library GEMM (`compose`), which is exactly `reference` when both are references.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from . import attn_output_gate as gate_op
from ._contract import Cost, Numerics, Shape, gen, randn

NAME = "gated_o_proj"
SIGNATURE = (
    "gated_o_proj(attn[T,Hq,D] bf16, gate[T,Hq,D] bf16, bias[Hq] bf16, weight[H, Hq*D] bf16) "
    "-> [T,H] bf16"
)
AXES = {"T": "tokens (varies)", "Hq": "query heads per rank (config/TP)", "D": "head_dim (config)",
        "H": "hidden (config)"}
# Test shapes (model/ops/_contract.py "Test shapes").
CPU_DIMS = {"Hq": 6, "D": 128, "H": 320}
FREE_DIMS = {"Hq": (1, 12), "H": (8, 640)}
EDGE_SCALES = {"tiny": {0: 2.0**-40}, "huge": {0: 2.0**40}}
# The ops a composed default is built from (see `compose`).
PARTS = ("attn_output_gate",)


def _gemm(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(a.flatten(1), weight)


def reference(attn, gate, bias, weight):
    return _gemm(gate_op.reference(attn, gate, bias), weight)


def compose(parts: Mapping[str, Callable]) -> Callable:
    """The op from a table's implementations of PARTS: its gate, then the library GEMM."""
    gate = parts["attn_output_gate"]

    def gated_o_proj(attn, gate_in, bias, weight):
        return _gemm(gate(attn, gate_in, bias), weight)

    return gated_o_proj


# `compose` as the tail of a variant module whose part's `run` is bound to `_attn_output_gate`:
# the served composition timed in the judge's worker as the bar for a fused kernel
# (model/registry/composite.py). tests/test_registry_composite.py holds the two to the same bits.
COMPOSED_RUN = """
import torch.nn.functional as _F


def run(attn, gate, bias, weight, config=None):
    a = _attn_output_gate(attn, gate, bias, config=config)
    return _F.linear(a.flatten(1), weight)
"""


def _unrounded_gated(attn, gate, bias, weight):
    # Near miss: the gated activation enters the GEMM in FP32, never rounded to BF16 (what a
    # prologue that keeps its registers in FP32 computes).
    g2 = gate + bias[None, :, None]
    a = attn.float() * torch.sigmoid(g2.float()).to(attn.dtype).float()
    return F.linear(a.flatten(1), weight.float()).to(attn.dtype)


def _bf16_split_k(attn, gate, bias, weight):
    # Near miss: split-K over the heads in two halves, each rounded to BF16, then a BF16 add.
    a = gate_op.reference(attn, gate, bias).flatten(1)
    h = a.shape[1] // 2
    return F.linear(a[:, :h], weight[:, :h]) + F.linear(a[:, h:], weight[:, h:])


def magnitude(attn, gate, bias, weight):
    """FP32 |a| @ |W|^T: the size of the terms the K reduction adds (they cancel)."""
    a = gate_op.reference(attn, gate, bias).flatten(1)
    return F.linear(a.float().abs(), weight.float().abs())


NUMERICS = Numerics(
    kind="ulp",
    max_ulp=1,
    # GEMM: the K reduction's order is the kernel's; 1-ulp differences are common (counted at
    # max(|out|, magnitude)). The gate before it is bitwise (a near miss checks its rounding).
    max_mismatch_fraction=0.05,
    near_misses={"unrounded_gated": _unrounded_gated, "bf16_split_k": _bf16_split_k},
    magnitude=magnitude,
)


def make_inputs(shape: Shape, seed: int, device="cpu", dtype=torch.bfloat16) -> tuple:
    g = gen(seed)
    t, hq, d, h = shape["T"], shape["Hq"], shape["D"], shape["H"]
    attn = randn((t, hq, d), g, dtype, device, scale=0.5)
    gate = randn((t, hq, d), g, dtype, device, scale=2.0)
    bias = randn((hq,), g, dtype, device, scale=1.0)
    weight = randn((h, hq * d), g, dtype, device, scale=(hq * d) ** -0.5)
    return attn, gate, bias, weight


def cost(shape: Shape) -> Cost:
    t, h, k = shape["T"], shape["H"], shape["Hq"] * shape["D"]
    # attn and gate read once, the bias, the weight streamed once, the output written.
    return Cost(bytes=2 * (2 * t * k + shape["Hq"] + h * k + t * h),
                flops=2 * t * k * h + 6 * t * k)


def shapes_for(cfg, tokens: int, shard=None) -> dict[str, int]:
    heads = shard.num_attention_heads if shard else cfg.num_attention_heads
    return {"T": tokens, "Hq": heads, "D": cfg.head_dim, "H": cfg.hidden_size}
