"""norm_residual_norm rowreg template: the sandwich boundary with the row in registers.

# {{HEADER}}
The design of the hand-written kernels/norm_residual_norm/triton_v3.py.

Formula (docs/numerics.md "Post-norm, depth-scaled residual, next pre-norm"), d = add_index:
    p  = bf( f32(w_post) * (f32(branch) * rsqrt(mean(f32(branch)^2) + eps)) )
    h' = bf( f32(bf(f32(p) * a)) + f32(bf(f32(h) * b)) )      a = 1/sqrt(d), b = sqrt((d-1)/d)
    n  = bf( f32(w_next) * (f32(h') * rsqrt(mean(f32(h')^2) + eps)) )
Rounding points: p, p*a, h*b, h' and n (five), explicit round-to-nearest-even on the bits; every
product torch rounds is `mul_rn`. Reductions: `tl.sum` over the whole row (Triton's tree, not
torch's lane order; squares of BF16 values are exact in FP32, so only the adds' order differs:
within the op's ulp policy, not bitwise). One program per row, every tensor read once, each
output written once.
Memory traffic: read 2*T*H + 2*H bf16, write 2*T*H bf16.
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
def _norm_residual_norm_row_kernel(
    branch_ptr, res_ptr, post_w_ptr, next_w_ptr, normed_ptr, new_res_ptr,
    stride_branch, stride_res, stride_normed, stride_new_res, inv_n, eps, scale_a, scale_b,
    N: tl.constexpr, BLOCK_H: tl.constexpr, ON_GPU: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BLOCK_H)
    m = o < N
    x = _bf16_to_f32(tl.load(branch_ptr + row * stride_branch + o, mask=m, other=0.0))
    h = _bf16_to_f32(tl.load(res_ptr + row * stride_res + o, mask=m, other=0.0))
    w_post = _bf16_to_f32(tl.load(post_w_ptr + o, mask=m, other=0.0))
    w_next = _bf16_to_f32(tl.load(next_w_ptr + o, mask=m, other=0.0))
    _sandwich(x, h, w_post, w_next, new_res_ptr + row * stride_new_res + o,
              normed_ptr + row * stride_normed + o, m, inv_n, eps, scale_a, scale_b, N, ON_GPU)


def run(branch, residual, post_weight, next_weight, add_index: int, eps: float,
        config: dict | None = None):
    """norm_residual_norm(...) -> (normed_next[T,H], new_residual[T,H]), both bf16."""
    if branch.dim() != 2 or residual.shape != branch.shape or branch.dtype != torch.bfloat16:
        raise ValueError(f"norm_residual_norm expects bf16 branch[T,H] and residual[T,H]; got "
                         f"{branch.dtype} {tuple(branch.shape)}, {tuple(residual.shape)}")
    if any(t.stride(-1) != 1 for t in (branch, residual, post_weight, next_weight)):
        raise ValueError("norm_residual_norm needs unit stride along H: pass .contiguous()")
    if add_index < 2:
        raise ValueError(f"add_index must be >= 2 (2(L+1) or 2(L+1)+1), got {add_index}")
    t, h = branch.shape
    normed = torch.empty((t, h), dtype=branch.dtype, device=branch.device)
    new_res = torch.empty((t, h), dtype=branch.dtype, device=branch.device)
    if t == 0 or h == 0:
        return normed, new_res
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    block_h = triton.next_power_of_2(h)
    inv_n = float(np.float32(1.0) / np.float32(h))
    scale_a, scale_b = 1.0 / math.sqrt(add_index), math.sqrt((add_index - 1) / add_index)
    _norm_residual_norm_row_kernel[(t,)](
        branch, residual, post_weight, next_weight, normed, new_res,
        branch.stride(0), residual.stride(0), normed.stride(0), new_res.stride(0),
        inv_n, eps, scale_a, scale_b, N=h, BLOCK_H=block_h, ON_GPU=branch.is_cuda,
        num_warps=cfg.get("num_warps") or max(2, min(16, block_h // 1024)))
    return normed, new_res
