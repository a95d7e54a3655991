"""swiglu(gate[T,I], up[T,I]) -> [T,I]

out = bf( silu_f32(gate) * f32(up) ), rounded once (docs/numerics.md "SwiGLU"). Used by the
three dense MLP layers and inside every expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._contract import Cost, Numerics, Shape, gen, randn

NAME = "swiglu"
SIGNATURE = "swiglu(gate[T,I] bf16, up[T,I] bf16) -> [T,I] bf16"
AXES = {"T": "tokens (varies)", "I": "intermediate size per rank (config/TP)"}
# Test shapes (model/ops/_contract.py "Test shapes").
CPU_DIMS = {"I": 320}
FREE_DIMS = {"I": (8, 1024)}
# Huge up with a saturated gate stays finite in FP32 (|silu(g)| <= 16, |up| ~ 2^60).
EDGE_SCALES = {"tiny": {0: 2.0**-40, 1: 2.0**-40}, "huge": {0: 2.0**3, 1: 2.0**60}}


def reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def _bf16_two_step(gate, up):
    # Near miss: silu rounded to BF16 before the product (differs in ~27% of outputs).
    return F.silu(gate) * up


def _sigmoid_rounded(gate, up):
    # Near miss: sigmoid(g) rounded to BF16 inside the silu.
    gf = gate.float()
    return (gf * torch.sigmoid(gf).to(gate.dtype).float() * up.float()).to(gate.dtype)


NUMERICS = Numerics(
    kind="bitwise",
    near_misses={"bf16_two_step": _bf16_two_step, "sigmoid_rounded": _sigmoid_rounded},
)


def make_inputs(shape: Shape, seed: int, device="cpu", dtype=torch.bfloat16) -> tuple:
    g = gen(seed)
    t, i = shape["T"], shape["I"]
    return randn((t, i), g, dtype, device, scale=2.0), randn((t, i), g, dtype, device, scale=1.0)


def cost(shape: Shape) -> Cost:
    n = shape["T"] * shape["I"]
    return Cost(bytes=2 * 3 * n, flops=6 * n)


def shapes_for(cfg, tokens: int, shard=None, moe: bool = False) -> dict[str, int]:
    if moe:
        inter = shard.moe_intermediate_size if shard else cfg.moe_intermediate_size
        return {"T": tokens * cfg.num_experts_per_tok, "I": inter}
    inter = shard.intermediate_size if shard else cfg.intermediate_size
    return {"T": tokens, "I": inter}


def test_shapes(cfg, shard, tokens: int, kind: str) -> list[dict[str, int]]:
    """CPU: CPU_DIMS; GPU: both uses, the dense MLP and inside the experts (T*k rows)."""
    if kind == "cpu":
        return [{"T": tokens, **CPU_DIMS}]
    return [shapes_for(cfg, tokens, shard), shapes_for(cfg, tokens, shard, moe=True)]
