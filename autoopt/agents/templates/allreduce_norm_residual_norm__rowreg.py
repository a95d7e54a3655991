"""allreduce_norm_residual_norm rowreg template: rank sum + sandwich, the row in registers.

# {{HEADER}}
The design of the hand-written kernels/allreduce_norm_residual_norm/triton_v2.py.

The TP boundary (model/ops/allreduce_norm_residual_norm.py; docs/numerics.md "Post-norm,
depth-scaled residual, next pre-norm" and "Tensor parallelism") on the stacked rank partials:
    x  = bf( ((f32(p_0) + f32(p_1)) + f32(p_2)) + ... )        rank order, FP32, one rounding
    p  = bf( f32(w_post) * (f32(x) * rsqrt(mean(f32(x)^2) + eps)) )
    h' = bf( f32(bf(f32(p) * a)) + f32(bf(f32(h) * b)) )      a = 1/sqrt(d), b = sqrt((d-1)/d)
    n  = bf( f32(w_next) * (f32(h') * rsqrt(mean(f32(h')^2) + eps)) )
Rounding points: x, p, p*a, h*b, h' and n (six), explicit round-to-nearest-even on the bits;
every product torch rounds is `mul_rn`. Reductions: `tl.sum` over the whole row (within the op's
ulp policy, not bitwise). One program per row: each partial read once, each output written once.
Memory traffic: read (R + 1)*T*H + 2*H bf16, write 2*T*H bf16.
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


# {{common.bf16_to_f32}}: _bf16_to_f32


# {{common.f32_to_bf16}}: _f32_to_bf16


# {{rowreg.ops}}: _round, _mul, _inv_rms


# {{rowreg.sandwich}}: _sandwich


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
    h = _bf16_to_f32(tl.load(res_ptr + row * stride_res + o, mask=m, other=0.0))
    w_post = _bf16_to_f32(tl.load(post_w_ptr + o, mask=m, other=0.0))
    w_next = _bf16_to_f32(tl.load(next_w_ptr + o, mask=m, other=0.0))
    _sandwich(_round(acc), h, w_post, w_next, new_res_ptr + row * stride_new_res + o,
              normed_ptr + row * stride_normed + o, m, inv_n, eps, scale_a, scale_b, N, ON_GPU)


def run(partials, residual, post_weight, next_weight, add_index: int, eps: float,
        config: dict | None = None):
    """allreduce_norm_residual_norm(...) -> (normed_next[T,H], new_residual[T,H]), both bf16."""
    if partials.dim() != 3 or partials.shape[0] < 1 or residual.shape != partials.shape[1:] \
            or partials.dtype != torch.bfloat16:
        raise ValueError("allreduce_norm_residual_norm expects bf16 partials[R,T,H] and "
                         f"residual[T,H]; got {partials.dtype} {tuple(partials.shape)}, "
                         f"{tuple(residual.shape)}")
    if any(t.stride(-1) != 1 for t in (partials, residual, post_weight, next_weight)):
        raise ValueError("allreduce_norm_residual_norm needs unit stride along H: pass "
                         ".contiguous()")
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
    scale_a, scale_b = 1.0 / math.sqrt(add_index), math.sqrt((add_index - 1) / add_index)
    _allreduce_norm_residual_norm_row_kernel[(t,)](
        partials, residual, post_weight, next_weight, normed, new_res,
        partials.stride(0), partials.stride(1), residual.stride(0), normed.stride(0),
        new_res.stride(0), inv_n, eps, scale_a, scale_b, N=h, R=r, BLOCK_H=block_h,
        ON_GPU=partials.is_cuda,
        num_warps=cfg.get("num_warps") or max(2, min(16, block_h // 1024)))
    return normed, new_res
