"""Helpers of the `rowsum` family (rmsnorm, norm_residual_norm): one row per program in torch's
CUDA last-dim reduction order.

Snippet sections, inlined by template.py for `# {{rowsum.NAME}}: names` template lines: the
format and the rules are in _common.py's docstring.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

# The BF16 conversions, copied with the hand-written kernels/*/triton_v1.py: their text differs
# from _common.py's, their values do not. torch's thread limit (used by `layout`) rides along
# because the recorded variants have it in this place.
# {{snippet bf16}}
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
# {{end}}


# Separately rounded multiply, the lane tree and lane offsets of Reduce.cuh, rsqrt(mean + eps).
# {{snippet reduce}}
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
# {{end}}


# Host side: torch's reduction layout for [rows, n] and the default UNROLL.
# {{snippet layout}}
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
# {{end}}
