"""norm_residual_norm rowsum template: the whole sandwich boundary in one row program.

# {{HEADER}}
Copied from the hand-written kernels/norm_residual_norm/triton_v2.py.

Formula (docs/numerics.md "Post-norm, depth-scaled residual, next pre-norm"), d = add_index:
    p  = bf( f32(w_post) * (f32(branch) * rsqrt(mean(f32(branch)^2) + eps)) )
    h' = bf( f32(bf(f32(p) * a)) + f32(bf(f32(h) * b)) )      a = 1/sqrt(d), b = sqrt((d-1)/d)
    n  = bf( f32(w_next) * (f32(h') * rsqrt(mean(f32(h')^2) + eps)) )
Rounding points: p, p*a, h*b, h' and n (five), each an explicit round-to-nearest-even on the bit
pattern so the Triton interpreter (whose BF16 cast truncates) computes the GPU's bits.
Reductions: both sums of squares follow torch's CUDA last-dim reduction for this many rows
(lanes t add float4 vectors t, t+TX, ... into four accumulators, ((a0+a1)+a2)+a3, then a halving
tree over the lanes; mean = sum * f32(1/H)); mul_rn/add_rn keep every FP32 operation that torch
runs as a separate kernel separately rounded (no FMA). On the CPU (interpreter) the mean
divides by H as torch's CPU mean does, but torch's CPU reduction order is not reproduced: within
1 ulp there.
Passes per row: (1) sum of squares of branch; (2) p, h' -> new_residual and the sum of squares of
h'; (3) n from h' re-read after a CTA barrier.
Memory traffic: read 2*T*H + 2*H bf16, write 2*T*H bf16 (second reads of branch and h' hit L2).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

# The reduction layout is fixed by the numerics (it must be torch's); warps and how many chunks
# are loaded per loop iteration are free.
CONFIG_SPACE = {"num_warps": [1, 2, 4, 8, 16], "UNROLL": [1, 2, 4, 8]}
# Unset keys follow the torch block width: one warp per 32 lanes, ~2048 elements per iteration.
DEFAULT_CONFIG: dict = {}
# {{rowsum.bf16}}: _TORCH_MAX_THREADS, _bf16_to_f32, _f32_to_bf16


# {{rowsum.reduce}}: _mul, _halve, _lane_tree, _lane_offsets, _inv_rms


@triton.jit
def _norm_residual_norm_fwd_kernel(
    branch_ptr, res_ptr, post_w_ptr, next_w_ptr, normed_ptr, new_res_ptr,
    stride_branch, stride_res, stride_normed, stride_new_res, inv_n, eps, scale_a, scale_b,
    N: tl.constexpr, TX: tl.constexpr, VEC: tl.constexpr, NCHUNK: tl.constexpr,
    UNROLL: tl.constexpr, ON_GPU: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    branch_row = branch_ptr + row * stride_branch
    res_row = res_ptr + row * stride_res
    new_res_row = new_res_ptr + row * stride_new_res
    normed_row = normed_ptr + row * stride_normed
    offs = _lane_offsets(TX, VEC)

    # Chunks in order (each accumulator adds left to right); UNROLL of them are loaded per
    # iteration so their loads overlap, which changes nothing in the order of the adds.
    acc = tl.zeros([TX, 4], dtype=tl.float32)
    for k0 in range(0, NCHUNK, UNROLL):
        for u in tl.static_range(UNROLL):
            o = (k0 + u) * (4 * TX) + offs
            x = _bf16_to_f32(tl.load(branch_row + o, mask=o < N, other=0.0))
            acc = acc + _mul(x, x, ON_GPU)
    r_post = _inv_rms(_lane_tree(acc, TX), inv_n, N, eps, ON_GPU)

    acc = tl.zeros([TX, 4], dtype=tl.float32)
    for k0 in range(0, NCHUNK, UNROLL):
        for u in tl.static_range(UNROLL):
            o = (k0 + u) * (4 * TX) + offs
            m = o < N
            x = _bf16_to_f32(tl.load(branch_row + o, mask=m, other=0.0))
            w = _bf16_to_f32(tl.load(post_w_ptr + o, mask=m, other=0.0))
            h = _bf16_to_f32(tl.load(res_row + o, mask=m, other=0.0))
            p = _bf16_to_f32(_f32_to_bf16(w * (x * r_post)))
            pa = _bf16_to_f32(_f32_to_bf16(p * scale_a))
            hb = _bf16_to_f32(_f32_to_bf16(h * scale_b))
            h_new = _f32_to_bf16(pa + hb)
            tl.store(new_res_row + o, h_new, mask=m)
            hf = _bf16_to_f32(h_new)
            acc = acc + _mul(hf, hf, ON_GPU)
    r_next = _inv_rms(_lane_tree(acc, TX), inv_n, N, eps, ON_GPU)

    # Makes this CTA's writes of h' visible to all its threads before they are re-read.
    tl.debug_barrier()
    for k0 in range(0, NCHUNK, UNROLL):
        for u in tl.static_range(UNROLL):
            o = (k0 + u) * (4 * TX) + offs
            m = o < N
            hf = _bf16_to_f32(tl.load(new_res_row + o, mask=m, other=0.0))
            w = _bf16_to_f32(tl.load(next_w_ptr + o, mask=m, other=0.0))
            tl.store(normed_row + o, _f32_to_bf16(w * (hf * r_next)), mask=m)


# {{rowsum.layout}}: _last_pow2, torch_reduce_layout, default_unroll


def _check(branch, residual, post_weight, next_weight) -> None:
    shapes = (f"branch {tuple(branch.shape)}, residual {tuple(residual.shape)}, post_weight "
              f"{tuple(post_weight.shape)}, next_weight {tuple(next_weight.shape)}")
    if branch.dim() != 2 or residual.shape != branch.shape:
        raise ValueError(f"norm_residual_norm expects branch[T,H] and residual[T,H]; got {shapes}")
    h = branch.shape[1]
    if post_weight.shape != (h,) or next_weight.shape != (h,):
        raise ValueError(f"norm_residual_norm expects post/next weights [H]; got {shapes}")
    tensors = (branch, residual, post_weight, next_weight)
    if any(t.dtype != torch.bfloat16 for t in tensors):
        raise ValueError("norm_residual_norm expects bf16 tensors; got "
                         f"{[str(t.dtype) for t in tensors]}")
    if any(t.stride(-1) != 1 for t in tensors):
        raise ValueError(f"norm_residual_norm needs unit stride along H ({shapes}): pass "
                         ".contiguous() tensors")
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"all inputs must be on one device; got {[t.device for t in tensors]}")


def norm_residual_norm_fwd(branch, residual, post_weight, next_weight, add_index: int,
                           eps: float, num_warps: int | None = None, unroll: int | None = None):
    """Launch the row kernel with an explicit config (None: derived from the torch layout)."""
    _check(branch, residual, post_weight, next_weight)
    if add_index < 2:
        raise ValueError(f"add_index must be >= 2 (2(L+1) or 2(L+1)+1), got {add_index}")
    t, h = branch.shape
    normed = torch.empty((t, h), dtype=branch.dtype, device=branch.device)
    new_res = torch.empty((t, h), dtype=branch.dtype, device=branch.device)
    if t == 0 or h == 0:
        return normed, new_res
    tx, vec = torch_reduce_layout(t, h)
    inv_n = float(np.float32(1.0) / np.float32(h))
    # Python floats, rounded to FP32 at launch: torch's bf16-tensor-times-scalar does the same.
    scale_a, scale_b = 1.0 / math.sqrt(add_index), math.sqrt((add_index - 1) / add_index)
    nchunk = triton.cdiv(h, 4 * tx)
    _norm_residual_norm_fwd_kernel[(t,)](
        branch, residual, post_weight, next_weight, normed, new_res,
        branch.stride(0), residual.stride(0), normed.stride(0), new_res.stride(0),
        inv_n, eps, scale_a, scale_b,
        N=h, TX=tx, VEC=vec, NCHUNK=nchunk, UNROLL=unroll or default_unroll(tx, nchunk),
        ON_GPU=branch.is_cuda, num_warps=num_warps or max(1, min(16, tx // 32)),
    )
    return normed, new_res


def run(branch, residual, post_weight, next_weight, add_index: int, eps: float,
        config: dict | None = None):
    """norm_residual_norm(...) -> (normed_next[T,H], new_residual[T,H]), both bf16."""
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    return norm_residual_norm_fwd(branch, residual, post_weight, next_weight, add_index, eps,
                                  num_warps=cfg.get("num_warps"), unroll=cfg.get("UNROLL"))
