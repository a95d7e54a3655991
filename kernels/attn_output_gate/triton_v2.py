"""attn_output_gate triton_v2 (hand-written): the sigmoid output gate, elementwise, bitwise.

Formula (docs/numerics.md "Output gate"), per element of [T, Hq, D] with head j:
    g2 = bf( f32(gate) + f32(bias[j]) )
    s  = bf( 1 / (1 + exp(-f32(g2))) )        torch's sigmoid: IEEE divide, expf
    out = bf( f32(attn) * f32(s) )
Rounding points: three, each an explicit round-to-nearest-even on the bit pattern (the Triton
interpreter's BF16 cast truncates). The divide is `div_rn` (Triton's `/` is approximate on the
GPU) and exp is libdevice's expf on the GPU (`tl.exp`/`tl.sigmoid` are ex2.approx).
Layout: attn and gate are [T, Hq, D] with unit stride along D and any token and head strides
(gate is a column slice of the packed qkv+gate GEMM output; attention may return heads-major).
Memory traffic: read 2*T*Hq*D + Hq bf16, write T*Hq*D bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

CONFIG_SPACE = {"BLOCK": [256, 512, 1024, 2048], "num_warps": [1, 2, 4, 8]}
DEFAULT_CONFIG = {"BLOCK": 1024, "num_warps": 4}


@triton.jit
def _bf16_to_f32(x):
    # Exact widening through the bit pattern (the interpreter's float cast mishandles subnormals).
    return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _f32_to_bf16(x):
    # Round to nearest even on the bits: the interpreter's `.to(tl.bfloat16)` truncates.
    bits = x.to(tl.uint32, bitcast=True)
    hi = bits >> 16
    carry = ((bits & 0xFFFF) + 0x7FFF + (hi & 1)) >> 16  # no uint32 overflow, even for NaNs
    return tl.where(x != x, 0x7FC0, hi + carry).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _exp(x, ON_GPU: tl.constexpr):
    if ON_GPU:
        return libdevice.exp(x)  # __nv_expf, the expf torch's CUDA kernels call
    else:
        # The interpreter's FP32 exp is numpy's (often 1 ulp off); torch's CPU expf is nearly
        # correctly rounded, and so is an FP64 exp rounded to FP32.
        return tl.exp(x.to(tl.float64)).to(tl.float32)


@triton.jit
def _attn_output_gate_fwd_kernel(attn_ptr, gate_ptr, bias_ptr, out_ptr,
                                 stride_at, stride_ah, stride_gt, stride_gh, stride_out, C,
                                 D: tl.constexpr, BLOCK: tl.constexpr, ON_GPU: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # head * D + d
    m = cols < C
    head, d = cols // D, cols % D
    a = _bf16_to_f32(tl.load(attn_ptr + row * stride_at + head * stride_ah + d, mask=m, other=0.0))
    g = _bf16_to_f32(tl.load(gate_ptr + row * stride_gt + head * stride_gh + d, mask=m, other=0.0))
    b = _bf16_to_f32(tl.load(bias_ptr + head, mask=m, other=0.0))
    g2 = _bf16_to_f32(_f32_to_bf16(g + b))
    s = _bf16_to_f32(_f32_to_bf16(tl.div_rn(1.0, 1.0 + _exp(-g2, ON_GPU))))
    tl.store(out_ptr + row * stride_out + cols, _f32_to_bf16(a * s), mask=m)


def _check(attn: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor) -> None:
    shapes = f"attn {tuple(attn.shape)}, gate {tuple(gate.shape)}, bias {tuple(bias.shape)}"
    if attn.dim() != 3 or gate.shape != attn.shape or bias.shape != (attn.shape[1],):
        raise ValueError(f"attn_output_gate expects attn[T,Hq,D], gate[T,Hq,D], bias[Hq]; got "
                         f"{shapes}")
    if any(t.dtype != torch.bfloat16 for t in (attn, gate, bias)):
        raise ValueError(f"attn_output_gate expects bf16 inputs; got {attn.dtype}, {gate.dtype}, "
                         f"{bias.dtype}")
    for name, t in (("attn", attn), ("gate", gate)):
        if t.stride(2) != 1:
            raise ValueError(f"{name} {tuple(t.shape)} needs unit stride along D, got strides "
                             f"{t.stride()}: pass a .contiguous() tensor")
    if bias.stride(0) != 1:
        raise ValueError(f"bias must be contiguous, got stride {bias.stride()}")
    if len({attn.device, gate.device, bias.device}) != 1:
        raise ValueError(f"inputs on different devices: {attn.device}, {gate.device}, "
                         f"{bias.device}")


def attn_output_gate_fwd(attn: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor,
                         block: int = 1024, num_warps: int = 4) -> torch.Tensor:
    """Launch over (tokens, column blocks of Hq*D) with an explicit config."""
    _check(attn, gate, bias)
    t, hq, d = attn.shape
    out = torch.empty((t, hq, d), dtype=attn.dtype, device=attn.device)
    if out.numel() == 0:
        return out
    c = hq * d
    _attn_output_gate_fwd_kernel[(t, triton.cdiv(c, block))](
        attn, gate, bias, out, attn.stride(0), attn.stride(1), gate.stride(0), gate.stride(1),
        out.stride(0), c, D=d, BLOCK=block, ON_GPU=attn.is_cuda, num_warps=num_warps,
    )
    return out


def run(attn: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, config: dict | None = None):
    """attn_output_gate(attn[T,Hq,D], gate[T,Hq,D], bias[Hq]) -> [T,Hq,D], all bf16."""
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    return attn_output_gate_fwd(attn, gate, bias, block=cfg["BLOCK"], num_warps=cfg["num_warps"])
