"""Helpers of the `rows` family (qk_norm_rope, qk_norm_ssmax): per-head-row RMS in torch's order.

Snippet sections, inlined by template.py for `# {{rows.NAME}}: names` template lines: the
format and the rules are in _common.py's docstring.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


# Separately rounded FP32 mul/add, and the sum of squares of ROWS head rows in torch's CUDA
# order (32 lanes x float4 for D = 128, then a halving tree).
# {{snippet cuda_sum}}
@triton.jit
def _mul(a, b, ON_GPU: tl.constexpr):
    if ON_GPU:
        return libdevice.mul_rn(a, b)
    else:
        return a * b


@triton.jit
def _add(a, b, ON_GPU: tl.constexpr):
    if ON_GPU:
        return libdevice.add_rn(a, b)
    else:
        return a + b


@triton.jit
def _halve(v, ROWS: tl.constexpr, N: tl.constexpr):
    # One tree level per row: v[:, t] + v[:, t + N/2] for t < N/2.
    lo, hi = tl.split(tl.permute(tl.reshape(v, [ROWS, 2, N // 2]), [0, 2, 1]))
    return lo + hi


@triton.jit
def _row_sum_sq(x, ROWS: tl.constexpr, TX: tl.constexpr, VEC: tl.constexpr,
                ON_GPU: tl.constexpr):
    # x [ROWS, TX*VEC]: lane t owns elements t*VEC .. t*VEC+VEC-1 (VEC=4: a float4 load).
    sq = _mul(x, x, ON_GPU)
    if VEC == 4:
        even, odd = tl.split(tl.reshape(sq, [ROWS, TX, 2, 2]))
        a0, a2 = tl.split(even)
        a1, a3 = tl.split(odd)
        v = ((a0 + a1) + a2) + a3
    else:
        v = tl.reshape(sq, [ROWS, TX])
    if TX >= 256:
        v = _halve(v, ROWS, 256)
    if TX >= 128:
        v = _halve(v, ROWS, 128)
    if TX >= 64:
        v = _halve(v, ROWS, 64)
    if TX >= 32:
        v = _halve(v, ROWS, 32)
    if TX >= 16:
        v = _halve(v, ROWS, 16)
    if TX >= 8:
        v = _halve(v, ROWS, 8)
    if TX >= 4:
        v = _halve(v, ROWS, 4)
    if TX >= 2:
        v = _halve(v, ROWS, 2)
    return tl.reshape(v, [ROWS])
# {{end}}


# The same sum in torch's CPU order (interpreter only), and rsqrt(mean + eps). Needs cuda_sum
# (for _mul) above it.
# {{snippet cpu_sum_inv_rms}}
@triton.jit
def _seq_sum(v, M: tl.constexpr, N: tl.constexpr):
    # v [M, N] -> [M]: x0 + x1 + ... + x(N-1) left to right (N in 1, 2, 4, 8, 16, 32).
    if N == 1:
        return tl.reshape(v, [M])
    elif N == 2:
        a, b = tl.split(v)
        return a + b
    else:
        # Peel the lowest index bit each time: element i = 2 * j + bit.
        e, o = tl.split(tl.reshape(v, [M, N // 2, 2]))
        if N == 4:
            x0, x2 = tl.split(e)
            x1, x3 = tl.split(o)
            return ((x0 + x1) + x2) + x3
        else:
            # N >= 8: left-to-right over pairs (2j, 2j+1) of the halves, recursively unrolled.
            total = tl.zeros([M], tl.float32)
            for j in tl.static_range(N // 2):
                pick = (tl.arange(0, N // 2) == j)[None, :]
                total = total + tl.sum(tl.where(pick, e, 0.0), axis=1)
                total = total + tl.sum(tl.where(pick, o, 0.0), axis=1)
            return total


@triton.jit
def _cpu_row_sum_sq(x, ROWS: tl.constexpr, D: tl.constexpr, L: tl.constexpr):
    # torch's CPU order (ATen's vectorized inner sum): L-lane vectors, vector k added into
    # accumulator k % 4 left to right, then ((a0 + a1) + a2) + a3, then the L lanes left to
    # right. The interpreter runs this so CPU results match torch's bits; the GPU never does.
    J: tl.constexpr = D // (4 * L)
    sq = tl.reshape(x * x, [ROWS, J, 4, L])  # element (k = 4 j + i) * L + lane
    acc = _seq_sum(tl.reshape(tl.permute(sq, [0, 3, 2, 1]), [ROWS * L * 4, J]), ROWS * L * 4, J)
    lanes = _seq_sum(tl.reshape(acc, [ROWS * L, 4]), ROWS * L, 4)
    return _seq_sum(tl.reshape(lanes, [ROWS, L]), ROWS, L)


@triton.jit
def _inv_rms(total, inv_n, eps, ON_GPU: tl.constexpr):
    # torch's mean: sum * f32(1/N) (== sum / N for the power-of-two D)
    mean = _mul(total, inv_n, ON_GPU)
    if ON_GPU:
        return libdevice.rsqrt(libdevice.add_rn(mean, eps))
    else:
        return tl.rsqrt(mean + eps)
# {{end}}


# Host side: torch's CPU vector width and CUDA reduction layout for one head row.
# {{snippet layout}}
def cpu_lanes(d: int) -> int:
    """Lanes of torch's CPU float vectors (AVX512: 16, else 8), 0 if a row is not a whole number
    of 4-vector groups (then the interpreter uses the CUDA order, within the op's ulp policy)."""
    lanes = 16 if "AVX512" in torch.backends.cpu.get_cpu_capability() else 8
    return lanes if d % (4 * lanes) == 0 else 0


def torch_head_layout(d: int) -> tuple[int, int]:
    """(lanes, vector width) of torch's CUDA FP32 last-dim sum for a head row of d elements."""
    vec = 4 if d >= 128 else 1
    return max(1, min(d // vec, 512)), vec
# {{end}}


# The KV-cache write both Q/K norm ops do: where a head row's result goes (q: token-major
# [T, heads, D]; k and v: slot-major in the layer's cache [P * page, heads, D]), the bit copy of
# V's rows, and the host-side checks of the cache arguments.
# {{snippet kv_write}}
@triton.jit
def _dest(rows, rvalid, heads, slots_ptr, D: tl.constexpr, TO_CACHE: tl.constexpr):
    tok = (rows // heads).to(tl.int64)
    head = (rows % heads).to(tl.int64)
    if TO_CACHE:
        tok = tl.load(slots_ptr + tok, mask=rvalid, other=0).to(tl.int64)
    return (tok * heads + head) * D


@triton.jit
def _copy_v_rows(v_ptr, vc_ptr, slots_ptr, row0, n_rows, heads, stride_t, stride_h,
                 D: tl.constexpr, ROWS: tl.constexpr):
    rows = row0 + tl.arange(0, ROWS)
    rvalid = rows < n_rows
    cols = tl.arange(0, D)
    src = ((rows // heads).to(tl.int64) * stride_t + (rows % heads).to(tl.int64) * stride_h)
    v = tl.load(v_ptr + src[:, None] + cols[None, :], mask=rvalid[:, None], other=0.0)
    dst = _dest(rows, rvalid, heads, slots_ptr, D, True)
    tl.store(vc_ptr + dst[:, None] + cols[None, :], v, mask=rvalid[:, None])


def check_cache(k, v, k_cache, v_cache, slots) -> None:
    if v.shape != k.shape or v.dtype != k.dtype or v.stride(2) != 1:
        raise ValueError(f"v must be like k {tuple(k.shape)} {k.dtype} with unit stride along "
                         f"D; got {tuple(v.shape)} {v.dtype} strides {v.stride()}")
    if (k_cache.dim() != 4 or k_cache.shape != v_cache.shape
            or tuple(k_cache.shape[2:]) != tuple(k.shape[1:])):
        raise ValueError(f"k_cache/v_cache must be [P, page, Hkv, D] with [Hkv, D] = "
                         f"{tuple(k.shape[1:])}; got {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous (one layer's pages)")
    if k_cache.dtype != k.dtype or v_cache.dtype != k.dtype:
        raise ValueError(f"the cache must be {k.dtype}, got {k_cache.dtype}, {v_cache.dtype}")
    if slots.shape != (k.shape[0],) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be int32/int64 [{k.shape[0]}], got {tuple(slots.shape)} "
                         f"{slots.dtype}")
# {{end}}
