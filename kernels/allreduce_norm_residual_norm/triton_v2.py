"""allreduce_norm_residual_norm triton_v2 (hand-written): rank sum + sandwich, row in registers.

The TP boundary (model/ops/allreduce_norm_residual_norm.py; docs/numerics.md "Post-norm,
depth-scaled residual, next pre-norm" and "Tensor parallelism") on the stacked rank partials:
    x  = bf( ((f32(p_0) + f32(p_1)) + f32(p_2)) + ... )        rank order, FP32, one rounding
    p  = bf( f32(w_post) * (f32(x) * rsqrt(mean(f32(x)^2) + eps)) )
    h' = bf( f32(bf(f32(p) * a)) + f32(bf(f32(h) * b)) )      a = 1/sqrt(d), b = sqrt((d-1)/d)
    n  = bf( f32(w_next) * (f32(h') * rsqrt(mean(f32(h')^2) + eps)) )
Rounding points: x, p, p*a, h*b, h' and n (six), each an explicit round-to-nearest-even on the bit
pattern so the Triton interpreter (whose BF16 cast truncates) computes the GPU's bits; every
product whose FP32 result torch rounds is `mul_rn` (no FMA contraction). mean = sum * f32(1/H)
on the GPU, as torch's CUDA mean; sum / H on the CPU, as torch's CPU mean.
Reductions: `tl.sum` over the whole row, Triton's tree, not torch's lane order. The squares of
BF16 values are exact in FP32, so only the order of the adds differs; the sum moves by an FP32
ulp or two, the rsqrt with it, and a few BF16 roundings of p or n flip (the op's ulp policy).
triton_v1 keeps torch's order and is bitwise, at 20-51 us per decode row on an H200 (a
[512, 4] lane emulation and three passes, each re-reading the partials); this kernel trades that
for one pass.
One program per row: the R partials, the residual and both weights are loaded once (BLOCK_H >= H,
masked), the rank sum, both norms and the residual add run in registers, each output is stored
once.
Memory traffic: read (R + 1)*T*H + 2*H bf16, write 2*T*H bf16; nothing re-read.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

LANGUAGE = "triton"
# The numerics do not depend on warps: they only spread the row over more threads.
CONFIG_SPACE = {"num_warps": [2, 4, 8, 16]}
DEFAULT_CONFIG: dict = {}


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
def _round(x):
    return _bf16_to_f32(_f32_to_bf16(x))


@triton.jit
def _mul(a, b, ON_GPU: tl.constexpr):
    if ON_GPU:
        return libdevice.mul_rn(a, b)  # never contracted into an FMA
    else:
        return a * b


@triton.jit
def _inv_rms(total, inv_n, n, eps, ON_GPU: tl.constexpr):
    if ON_GPU:
        mean = libdevice.mul_rn(total, inv_n)  # torch's CUDA mean: sum * f32(1/N)
        return libdevice.rsqrt(libdevice.add_rn(mean, eps))
    else:
        mean = tl.div_rn(total, n * 1.0)  # torch's CPU mean: sum / N
        return tl.rsqrt(mean + eps)


@triton.jit
def _allreduce_norm_residual_norm_row_kernel(
    part_ptr, res_ptr, post_w_ptr, next_w_ptr, normed_ptr, new_res_ptr,
    stride_rank, stride_part, stride_res, stride_normed, stride_new_res, inv_n, eps, scale_a,
    scale_b, N: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr, ON_GPU: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BLOCK_H)
    m = o < N
    part_row = part_ptr + row * stride_part
    acc = _bf16_to_f32(tl.load(part_row + o, mask=m, other=0.0))
    for r in tl.static_range(1, R):  # FP32 in rank order, rounded once
        acc = acc + _bf16_to_f32(tl.load(part_row + r * stride_rank + o, mask=m, other=0.0))
    x = _round(acc)
    h = _bf16_to_f32(tl.load(res_ptr + row * stride_res + o, mask=m, other=0.0))
    w_post = _bf16_to_f32(tl.load(post_w_ptr + o, mask=m, other=0.0))
    w_next = _bf16_to_f32(tl.load(next_w_ptr + o, mask=m, other=0.0))

    r_post = _inv_rms(tl.sum(_mul(x, x, ON_GPU), axis=0), inv_n, N, eps, ON_GPU)
    p = _round(_mul(w_post, _mul(x, r_post, ON_GPU), ON_GPU))
    pa = _round(_mul(p, scale_a, ON_GPU))
    hb = _round(_mul(h, scale_b, ON_GPU))
    h_new = _f32_to_bf16(pa + hb)
    tl.store(new_res_ptr + row * stride_new_res + o, h_new, mask=m)

    hf = _bf16_to_f32(h_new)
    r_next = _inv_rms(tl.sum(_mul(hf, hf, ON_GPU), axis=0), inv_n, N, eps, ON_GPU)
    n = _f32_to_bf16(_mul(w_next, _mul(hf, r_next, ON_GPU), ON_GPU))
    tl.store(normed_ptr + row * stride_normed + o, n, mask=m)


def _check(partials, residual, post_weight, next_weight) -> None:
    shapes = (f"partials {tuple(partials.shape)}, residual {tuple(residual.shape)}, post_weight "
              f"{tuple(post_weight.shape)}, next_weight {tuple(next_weight.shape)}")
    if partials.dim() != 3 or partials.shape[0] < 1 or residual.shape != partials.shape[1:]:
        raise ValueError("allreduce_norm_residual_norm expects partials[R,T,H] (R >= 1) and "
                         f"residual[T,H]; got {shapes}")
    h = partials.shape[2]
    if post_weight.shape != (h,) or next_weight.shape != (h,):
        raise ValueError("allreduce_norm_residual_norm expects post/next weights [H]; got "
                         f"{shapes}")
    tensors = (partials, residual, post_weight, next_weight)
    if any(t.dtype != torch.bfloat16 for t in tensors):
        raise ValueError("allreduce_norm_residual_norm expects bf16 tensors; got "
                         f"{[str(t.dtype) for t in tensors]}")
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError(f"allreduce_norm_residual_norm needs unit stride along H ({shapes}): "
                         "pass .contiguous() tensors")
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"all inputs must be on one device; got {[t.device for t in tensors]}")


def default_warps(block_h: int) -> int:
    # About 32 elements of each row tensor per thread (four of them live at once).
    return max(2, min(16, block_h // 1024))


def run(partials, residual, post_weight, next_weight, add_index: int, eps: float,
        config: dict | None = None):
    """allreduce_norm_residual_norm(...) -> (normed_next[T,H], new_residual[T,H]), both bf16."""
    _check(partials, residual, post_weight, next_weight)
    if add_index < 2:
        raise ValueError(f"add_index must be >= 2 (2(L+1) or 2(L+1)+1), got {add_index}")
    r, t, h = partials.shape
    normed = torch.empty((t, h), dtype=partials.dtype, device=partials.device)
    new_res = torch.empty((t, h), dtype=partials.dtype, device=partials.device)
    if t == 0 or h == 0:
        return normed, new_res
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    block_h = triton.next_power_of_2(h)
    inv_n = float(np.float32(1.0) / np.float32(h))
    # Python floats, rounded to FP32 at launch: torch's bf16-tensor-times-scalar does the same.
    scale_a, scale_b = 1.0 / math.sqrt(add_index), math.sqrt((add_index - 1) / add_index)
    _allreduce_norm_residual_norm_row_kernel[(t,)](
        partials, residual, post_weight, next_weight, normed, new_res,
        partials.stride(0), partials.stride(1), residual.stride(0), normed.stride(0),
        new_res.stride(0), inv_n, eps, scale_a, scale_b, N=h, R=r, BLOCK_H=block_h,
        ON_GPU=partials.is_cuda, num_warps=cfg.get("num_warps") or default_warps(block_h))
    return normed, new_res
