"""rmsnorm triton_v2 (hand-written): one program per row, in torch's CUDA reduction order.

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
_TORCH_MAX_THREADS = 512  # Reduce.cuh max_reduce_threads for FP32


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
def _mul(a, b, ON_GPU: tl.constexpr):
    if ON_GPU:
        return libdevice.mul_rn(a, b)  # never contracted into an FMA
    else:
        return a * b


@triton.jit
def _halve(v, N: tl.constexpr):
    # One level of the lane tree: v[t] + v[t + N/2] for t < N/2.
    lo, hi = tl.split(tl.permute(tl.reshape(v, [2, N // 2]), [1, 0]))
    return lo + hi


@triton.jit
def _lane_tree(acc, TX: tl.constexpr):
    # acc [TX, 4]: combine the four accumulators in order, then halve TX down to one lane.
    even, odd = tl.split(tl.reshape(acc, [TX, 2, 2]))
    a0, a2 = tl.split(even)
    a1, a3 = tl.split(odd)
    v = ((a0 + a1) + a2) + a3
    if TX >= 512:
        v = _halve(v, 512)
    if TX >= 256:
        v = _halve(v, 256)
    if TX >= 128:
        v = _halve(v, 128)
    if TX >= 64:
        v = _halve(v, 64)
    if TX >= 32:
        v = _halve(v, 32)
    if TX >= 16:
        v = _halve(v, 16)
    if TX >= 8:
        v = _halve(v, 8)
    if TX >= 4:
        v = _halve(v, 4)
    if TX >= 2:
        v = _halve(v, 2)
    return v  # [1]


@triton.jit
def _lane_offsets(TX: tl.constexpr, VEC: tl.constexpr):
    # Element of lane t, accumulator i inside one chunk of 4*TX elements.
    t = tl.arange(0, TX)[:, None]
    i = tl.arange(0, 4)[None, :]
    if VEC == 4:
        return t * 4 + i  # float4 vector t: accumulator i holds component i
    else:
        return i * TX + t  # unvectorized: accumulator i holds every 4th stride-TX element


@triton.jit
def _inv_rms(total, inv_n, n, eps, ON_GPU: tl.constexpr):
    if ON_GPU:
        mean = libdevice.mul_rn(total, inv_n)  # torch's CUDA mean: sum * f32(1/N)
        return libdevice.rsqrt(libdevice.add_rn(mean, eps))
    else:
        mean = tl.div_rn(total, n * 1.0)  # torch's CPU mean: sum / N
        return tl.rsqrt(mean + eps)


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


def _last_pow2(n: int) -> int:
    return max(1, 1 << (max(n, 1).bit_length() - 1))


def torch_reduce_layout(rows: int, n: int) -> tuple[int, int]:
    """(lanes per row, vector width) of torch's CUDA FP32 sum over the last dim of [rows, n].

    Mirrors Reduce.cuh `setReduceConfig`: vectorised float4 loads from n >= 128; block width
    min(pow2(n/vec), 512 / min(pow2(rows), 512 / min(pow2(n/vec), 32))).
    """
    vec = 4 if n >= 128 else 1
    dim0 = max(n // vec, 1)
    d0 = _TORCH_MAX_THREADS if dim0 >= _TORCH_MAX_THREADS else _last_pow2(dim0)
    d1 = _TORCH_MAX_THREADS if rows >= _TORCH_MAX_THREADS else _last_pow2(rows)
    height = min(d1, _TORCH_MAX_THREADS // min(d0, 32))
    return min(d0, _TORCH_MAX_THREADS // height), vec


def default_unroll(tx: int, nchunk: int) -> int:
    # About 2048 elements in flight per iteration, never more chunks than the row has.
    return max(1, min(8, 2048 // (4 * tx), nchunk))


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
