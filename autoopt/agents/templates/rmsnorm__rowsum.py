"""rmsnorm rowsum template: one program per row, in torch's CUDA reduction order.

# {{HEADER}}
Copied from the hand-written kernels/rmsnorm/triton_v2.py.

Formula (docs/numerics.md "RMSNorm"):
    y = bf( f32(w) * ( f32(x) * rsqrt(mean(f32(x)^2) + eps) ) )
Rounding points: one, the BF16 output (explicit round-to-nearest-even on the bit pattern, so the
Triton interpreter, whose BF16 cast truncates, computes the same bits as the GPU).
Reduction: the sum of squares follows torch's CUDA last-dim reduction (ATen Reduce.cuh) for this
many rows: `TX` threads per row each add float4 vectors t, t+TX, ... into four accumulators,
combine them ((a0+a1)+a2)+a3, then a halving tree over the TX lanes; mean = sum * f32(1/H).
On the GPU every FP32 operation torch does in a separate kernel is a separately rounded
instruction here (`mul_rn`/`add_rn`: no FMA contraction); `rsqrt` and the order match torch's.
On the CPU (interpreter) the mean divides by H as torch's CPU mean does, but torch's CPU
reduction order is not reproduced: within 1 ulp there.
Memory traffic: read T*H + H bf16, write T*H bf16 (the second read of x hits L2).
"""

from __future__ import annotations

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
def _rmsnorm_fwd_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, inv_n, eps,
                        N: tl.constexpr, TX: tl.constexpr, VEC: tl.constexpr,
                        NCHUNK: tl.constexpr, UNROLL: tl.constexpr, ON_GPU: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    out_row = out_ptr + row * stride_out
    offs = _lane_offsets(TX, VEC)
    acc = tl.zeros([TX, 4], dtype=tl.float32)
    # Chunks in order (each accumulator adds left to right); UNROLL of them are loaded per
    # iteration so their loads overlap, which changes nothing in the order of the adds.
    for k0 in range(0, NCHUNK, UNROLL):
        for u in tl.static_range(UNROLL):
            o = (k0 + u) * (4 * TX) + offs
            x = _bf16_to_f32(tl.load(x_row + o, mask=o < N, other=0.0))
            acc = acc + _mul(x, x, ON_GPU)
    r = _inv_rms(_lane_tree(acc, TX), inv_n, N, eps, ON_GPU)
    for k0 in range(0, NCHUNK, UNROLL):
        for u in tl.static_range(UNROLL):
            o = (k0 + u) * (4 * TX) + offs
            m = o < N
            x = _bf16_to_f32(tl.load(x_row + o, mask=m, other=0.0))
            w = _bf16_to_f32(tl.load(w_ptr + o, mask=m, other=0.0))
            tl.store(out_row + o, _f32_to_bf16(w * (x * r)), mask=m)


# {{rowsum.layout}}: _last_pow2, torch_reduce_layout, default_unroll


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2 or weight.dim() != 1 or weight.shape[0] != x.shape[1]:
        raise ValueError(f"rmsnorm expects x[T,H] and weight[H]; got x {tuple(x.shape)}, weight "
                         f"{tuple(weight.shape)}")
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        raise ValueError(f"rmsnorm expects bf16 x and weight; got {x.dtype}, {weight.dtype}")
    if x.stride(1) != 1 or weight.stride(0) != 1:
        raise ValueError(f"rmsnorm needs unit stride along H; x strides {x.stride()}, weight "
                         f"strides {weight.stride()}: pass .contiguous() tensors")
    if x.device != weight.device:
        raise ValueError(f"x on {x.device} but weight on {weight.device}")


def rmsnorm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float,
                num_warps: int | None = None, unroll: int | None = None) -> torch.Tensor:
    """Launch the row kernel with an explicit config (None: derived from the torch layout)."""
    _check(x, weight)
    t, h = x.shape
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    if t == 0 or h == 0:
        return out
    tx, vec = torch_reduce_layout(t, h)
    inv_n = float(np.float32(1.0) / np.float32(h))
    nchunk = triton.cdiv(h, 4 * tx)
    _rmsnorm_fwd_kernel[(t,)](
        x, weight, out, x.stride(0), out.stride(0), inv_n, eps,
        N=h, TX=tx, VEC=vec, NCHUNK=nchunk, UNROLL=unroll or default_unroll(tx, nchunk),
        ON_GPU=x.is_cuda, num_warps=num_warps or max(1, min(16, tx // 32)),
    )
    return out


def run(x: torch.Tensor, weight: torch.Tensor, eps: float, config: dict | None = None):
    """rmsnorm(x[T,H] bf16, weight[H] bf16, eps) -> [T,H] bf16."""
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    return rmsnorm_fwd(x, weight, eps, num_warps=cfg.get("num_warps"), unroll=cfg.get("UNROLL"))
