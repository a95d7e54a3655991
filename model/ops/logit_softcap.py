"""logit_softcap(logits[T,V], cap) -> FP32 [T,V]

out = f32(tanh(f32(z) / cap)) * cap, all FP32; the FP32 logits are the model's output and are
never stored as BF16 (docs/numerics.md "Final norm, lm_head, softcap").
"""

from __future__ import annotations

import torch

from ._contract import Cost, Numerics, Shape, gen, randn

NAME = "logit_softcap"
SIGNATURE = "logit_softcap(logits[T,V] bf16, cap: float) -> [T,V] fp32"
AXES = {"T": "tokens (varies)", "V": "vocab per rank (config/TP)"}
# Test shapes (model/ops/_contract.py "Test shapes").
CPU_DIMS = {"V": 997}
FREE_DIMS = {"V": (8, 2048)}
# Huge logits saturate tanh; tiny ones sit in its linear part.
EDGE_SCALES = {"tiny": {0: 2.0**-60}, "huge": {0: 2.0**10}}


def reference(logits: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(logits.float() / cap) * cap


def _bf16_tanh(logits, cap):
    # Near miss: tanh evaluated in BF16 (quantizes badly near saturation).
    return torch.tanh(logits / cap).float() * cap


def _other_division(logits, cap):
    # Near miss: the division torch does NOT do on this device (differs in the last FP32 bit for
    # many inputs). For a tensor divided by a Python float, torch's CUDA kernel multiplies by the
    # FP32 reciprocal (ATen div_true_kernel_cuda) while its CPU kernel divides, so a fixed
    # "x * (1/cap)" near miss would be the reference itself on the GPU.
    xf = logits.float()
    if xf.is_cuda:
        return torch.tanh(xf / torch.full_like(xf, cap)) * cap
    return torch.tanh(xf * (1.0 / cap)) * cap


NUMERICS = Numerics(
    kind="bitwise",
    near_misses={"bf16_tanh": _bf16_tanh, "other_division": _other_division},
    note="FP32 output; tanh implementations may differ by 1 FP32 ulp between CPU and GPU libm",
)


def make_inputs(shape: Shape, seed: int, device="cpu", dtype=torch.bfloat16) -> tuple:
    g = gen(seed)
    # Logits spread past the cap so both the linear and the saturated parts are exercised.
    return randn((shape["T"], shape["V"]), g, dtype, device, scale=25.0), 30.0


def cost(shape: Shape) -> Cost:
    n = shape["T"] * shape["V"]
    return Cost(bytes=(2 + 4) * n, flops=4 * n)


def shapes_for(cfg, tokens: int, shard=None) -> dict[str, int]:
    return {"T": tokens, "V": shard.vocab_size if shard else cfg.vocab_size}
