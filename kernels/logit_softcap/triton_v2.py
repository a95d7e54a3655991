"""logit_softcap triton_v2 (hand-written): FP32 logits = tanh(z / cap) * cap, bitwise.

Formula (docs/numerics.md "Final norm, lm_head, softcap"): out = f32( tanh(f32(z) / cap) ) * cap,
with no BF16 rounding: the output is FP32. The division is whatever torch does for a tensor divided
by a Python float on this device: on CUDA it multiplies by the FP32 reciprocal
(`f32(z) * f32(1/cap)`, ATen div_true_kernel_cuda), on the CPU it divides. On the GPU tanh is
libdevice's tanhf (what torch calls) and the product is `mul_rn` (no FMA into tanh's first add).
On the CPU (interpreter, no libdevice) tanh is evaluated in FP64 and rounded, which is within
1 FP32 ulp of torch's CPU tanhf (equal in all but ~1e-4 of values).
Memory traffic: read T*V bf16, write T*V fp32.
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
def _tanh(y, ON_GPU: tl.constexpr):
    if ON_GPU:
        return libdevice.tanh(y)
    else:
        d = y.to(tl.float64)
        ad = tl.abs(d)
        e = tl.exp(-2.0 * ad)
        big = (1.0 - e) / (1.0 + e)
        # Near 0, 1 - e cancels; the series is exact to FP64 precision below 1e-4.
        small = ad - ad * ad * ad / 3.0
        th = tl.where(ad < 1e-4, small, big)
        th = tl.where(d < 0, -th, th)
        th = tl.where(ad == 0, d, th)  # keeps the sign of zero
        return th.to(tl.float32)


@triton.jit
def _logit_softcap_fwd_kernel(z_ptr, out_ptr, stride_z, stride_out, C, cap, inv_cap,
                              BLOCK: tl.constexpr, ON_GPU: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < C
    z = _bf16_to_f32(tl.load(z_ptr + row * stride_z + cols, mask=m, other=0.0))
    if ON_GPU:
        y = libdevice.mul_rn(z, inv_cap)
    else:
        y = tl.div_rn(z, cap)
    tl.store(out_ptr + row * stride_out + cols, _tanh(y, ON_GPU) * cap, mask=m)


def _check(logits: torch.Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logit_softcap expects logits[T,V]; got shape {tuple(logits.shape)}")
    if logits.dtype != torch.bfloat16:
        raise ValueError(f"logit_softcap expects bf16 logits; got {logits.dtype}")
    if logits.stride(1) != 1:
        raise ValueError(f"logits {tuple(logits.shape)} need unit stride along V, got strides "
                         f"{logits.stride()}: pass a .contiguous() tensor")


def logit_softcap_fwd(logits: torch.Tensor, cap: float, block: int = 1024,
                      num_warps: int = 4) -> torch.Tensor:
    """Launch over (tokens, column blocks of V) with an explicit config."""
    _check(logits)
    if not cap > 0:
        raise ValueError(f"cap must be a positive float, got {cap}")
    t, c = logits.shape
    out = torch.empty((t, c), dtype=torch.float32, device=logits.device)
    if out.numel() == 0:
        return out
    # A Python float, rounded to FP32 at launch, as torch rounds its FP64 reciprocal.
    inv_cap = 1.0 / cap
    _logit_softcap_fwd_kernel[(t, triton.cdiv(c, block))](
        logits, out, logits.stride(0), out.stride(0), c, cap, inv_cap,
        BLOCK=block, ON_GPU=logits.is_cuda, num_warps=num_warps,
    )
    return out


def run(logits: torch.Tensor, cap: float, config: dict | None = None) -> torch.Tensor:
    """logit_softcap(logits[T,V] bf16, cap) -> [T,V] fp32."""
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    return logit_softcap_fwd(logits, cap, block=cfg["BLOCK"], num_warps=cfg["num_warps"])
