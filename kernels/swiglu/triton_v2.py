"""swiglu triton_v2 (hand-written): SiLU(gate) * up, elementwise, bitwise.

Formula (docs/numerics.md "SwiGLU"):
    out = bf( f32( f32(g) / (1 + exp(-f32(g))) ) * f32(up) )
torch's silu is `x / (1 + expf(-x))` in FP32 (IEEE divide), then an FP32 multiply; one rounding
point, the BF16 output, done as an explicit round-to-nearest-even on the bit pattern (the Triton
interpreter's BF16 cast truncates). The divide is `div_rn` (Triton's `/` is approximate on the
GPU) and exp is libdevice's expf on the GPU (`tl.exp`/`tl.sigmoid` are ex2.approx).
Layout: gate and up are [T, I] with unit stride along I and any row stride (inside the experts
they are the two column halves of one GEMM output).
Memory traffic: read 2*T*I bf16, write T*I bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

CONFIG_SPACE = {"BLOCK": [256, 512, 1024, 2048, 4096], "num_warps": [1, 2, 4, 8]}
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
def _swiglu_fwd_kernel(gate_ptr, up_ptr, out_ptr, stride_gate, stride_up, stride_out, C,
                       BLOCK: tl.constexpr, ON_GPU: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < C
    g = _bf16_to_f32(tl.load(gate_ptr + row * stride_gate + cols, mask=m, other=0.0))
    u = _bf16_to_f32(tl.load(up_ptr + row * stride_up + cols, mask=m, other=0.0))
    silu = tl.div_rn(g, 1.0 + _exp(-g, ON_GPU))
    tl.store(out_ptr + row * stride_out + cols, _f32_to_bf16(silu * u), mask=m)


def _check(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.dim() != 2 or up.shape != gate.shape:
        raise ValueError(f"swiglu expects gate[T,I] and up[T,I]; got gate {tuple(gate.shape)}, "
                         f"up {tuple(up.shape)}")
    if gate.dtype != torch.bfloat16 or up.dtype != torch.bfloat16:
        raise ValueError(f"swiglu expects bf16 gate and up; got {gate.dtype}, {up.dtype}")
    if gate.stride(1) != 1 or up.stride(1) != 1:
        raise ValueError(f"swiglu needs unit stride along I; gate strides {gate.stride()}, up "
                         f"strides {up.stride()}: pass .contiguous() tensors")
    if gate.device != up.device:
        raise ValueError(f"gate on {gate.device} but up on {up.device}")


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor, block: int = 1024,
               num_warps: int = 4) -> torch.Tensor:
    """Launch over (tokens, column blocks of I) with an explicit config."""
    _check(gate, up)
    t, c = gate.shape
    out = torch.empty((t, c), dtype=gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out
    _swiglu_fwd_kernel[(t, triton.cdiv(c, block))](
        gate, up, out, gate.stride(0), up.stride(0), out.stride(0), c,
        BLOCK=block, ON_GPU=gate.is_cuda, num_warps=num_warps,
    )
    return out


def run(gate: torch.Tensor, up: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """swiglu(gate[T,I] bf16, up[T,I] bf16) -> [T,I] bf16."""
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    return swiglu_fwd(gate, up, block=cfg["BLOCK"], num_warps=cfg["num_warps"])
