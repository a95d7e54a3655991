"""qk_norm_ssmax: per-head RMSNorm of q and k, then the SSMax query scale, fused in one launch.

# {{HEADER}}

Formula (NUMERICS.md "Q/K norm then SSMax"), per head row x[D] with its own weight w:
    n   = bf( f32(w) * ( f32(x) * rsqrt(mean(f32(x)^2) + eps) ) )        rounding 1 (q and k)
    tau = exp(0.1 * log1p((pos + 1) / 2048))                               FP32, per token
    q'  = bf( f32(n) * tau )                                               rounding 2 (q only)
exp/log1p (never pow), and tau is not folded into the softmax scale. On the GPU exp/log1p are
libdevice's (the functions torch's CUDA kernels call); the interpreter has neither libdevice nor
log1p, so there both are evaluated in FP64 and rounded, within the op's ulp(1) policy. The sum
of squares follows torch's CUDA order for the head row (32 lanes x 4 consecutive elements for
D = 128, then a halving tree), and torch's CPU order (AVX vectors into four accumulators) in
the interpreter. BF16 rounding is done on the bit pattern (the
interpreter's cast truncates). One program handles ROWS head rows of q or of k, one launch.
Memory traffic: read (Hq+Hkv)*T*D bf16 + T int64 positions, write (Hq+Hkv)*T*D bf16.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

CONFIG_SPACE = {"ROWS": [1, 2, 4, 8, 16], "num_warps": [1, 2, 4, 8]}
DEFAULT_CONFIG = {"ROWS": 4, "num_warps": 4}


@triton.jit
def _bf16_to_f32(x):
    return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _f32_to_bf16(x):
    # Round to nearest even on the bits: the interpreter's `.to(tl.bfloat16)` truncates.
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    rounded = tl.where(x != x, 0x7FC00000, rounded)
    return (rounded >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


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


@triton.jit
def _log1p(x, ON_GPU: tl.constexpr):
    if ON_GPU:
        return libdevice.log1p(x)  # __nv_log1pf, what torch's CUDA log1p calls
    else:
        # The interpreter has no log1p; in FP64 log(1 + x) is exact to well below an FP32 ulp.
        return tl.log(1.0 + x.to(tl.float64)).to(tl.float32)


@triton.jit
def _exp(x, ON_GPU: tl.constexpr):
    if ON_GPU:
        return libdevice.exp(x)  # __nv_expf, what torch's CUDA exp calls
    else:
        # numpy's FP32 exp is often 1 ulp off torch's CPU expf; FP64 exp rounded is not.
        return tl.exp(x.to(tl.float64)).to(tl.float32)


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


@triton.jit
def _norm_ssmax_rows(x_ptr, w_ptr, pos_ptr, out_ptr, row0, n_rows, heads, stride_t, stride_h,
                     inv_n, eps, D: tl.constexpr, TX: tl.constexpr, VEC: tl.constexpr,
                     ROWS: tl.constexpr, SCALE: tl.constexpr, CPU_LANES: tl.constexpr,
                     ON_GPU: tl.constexpr):
    rows = row0 + tl.arange(0, ROWS)
    rvalid = rows < n_rows
    rmask = rvalid[:, None]
    tok = (rows // heads).to(tl.int64)
    head = (rows % heads).to(tl.int64)
    cols = tl.arange(0, D)
    base = x_ptr + (tok * stride_t + head * stride_h)[:, None]
    x = _bf16_to_f32(tl.load(base + cols[None, :], mask=rmask, other=0.0))
    if CPU_LANES == 0:
        total = _row_sum_sq(x, ROWS, TX, VEC, ON_GPU)  # torch's CUDA order
    else:
        total = _cpu_row_sum_sq(x, ROWS, D, CPU_LANES)
    r = _inv_rms(total, inv_n, eps, ON_GPU)[:, None]
    w = _bf16_to_f32(tl.load(w_ptr + cols))[None, :]
    y = _f32_to_bf16(_mul(w, _mul(x, r, ON_GPU), ON_GPU))
    if SCALE:
        pos = tl.load(pos_ptr + tok, mask=rvalid, other=0).to(tl.float32)
        # torch: (pos.float() + 1) / 2048 (a power of two: the same as * 2^-11), log1p, * 0.1, exp
        u = _mul(_add(pos, 1.0, ON_GPU), 0.00048828125, ON_GPU)
        tau = _exp(_mul(_log1p(u, ON_GPU), 0.1, ON_GPU), ON_GPU)[:, None]
        y = _f32_to_bf16(_mul(_bf16_to_f32(y), tau, ON_GPU))
    out = out_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :]
    tl.store(out, y, mask=rmask)


@triton.jit
def _qk_norm_ssmax_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, pos_ptr, qo_ptr, ko_ptr,
                          T, HQ, HKV, q_st, q_sh, k_st, k_sh, inv_n, eps,
                          D: tl.constexpr, TX: tl.constexpr, VEC: tl.constexpr,
                          ROWS: tl.constexpr, CPU_LANES: tl.constexpr,
                          ON_GPU: tl.constexpr):
    pid = tl.program_id(0)
    q_programs = tl.cdiv(T * HQ, ROWS)
    if pid < q_programs:
        _norm_ssmax_rows(q_ptr, qw_ptr, pos_ptr, qo_ptr, pid * ROWS, T * HQ, HQ, q_st, q_sh,
                         inv_n, eps, D, TX, VEC, ROWS, True, CPU_LANES, ON_GPU)
    else:
        _norm_ssmax_rows(k_ptr, kw_ptr, pos_ptr, ko_ptr, (pid - q_programs) * ROWS, T * HKV,
                         HKV, k_st, k_sh, inv_n, eps, D, TX, VEC, ROWS, False, CPU_LANES,
                         ON_GPU)


def cpu_lanes(d: int) -> int:
    """Lanes of torch's CPU float vectors (AVX512: 16, else 8), 0 if a row is not a whole number
    of 4-vector groups (then the interpreter uses the CUDA order, within the op's ulp policy)."""
    lanes = 16 if "AVX512" in torch.backends.cpu.get_cpu_capability() else 8
    return lanes if d % (4 * lanes) == 0 else 0


def torch_head_layout(d: int) -> tuple[int, int]:
    """(lanes, vector width) of torch's CUDA FP32 last-dim sum for a head row of d elements."""
    vec = 4 if d >= 128 else 1
    return max(1, min(d // vec, 512)), vec


def _check(q, k, q_weight, k_weight, positions) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"qk_norm_ssmax expects q[T,Hq,D], k[T,Hkv,D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}")
    t, _, d = q.shape
    if d & (d - 1) or d < 2:
        raise ValueError(f"head_dim {d} must be a power of two for this template")
    if tuple(q_weight.shape) != (d,) or tuple(k_weight.shape) != (d,):
        raise ValueError(f"q_weight/k_weight must be [{d}]")
    if tuple(positions.shape) != (t,) or positions.dtype.is_floating_point:
        raise ValueError(f"positions must be integer [{t}], got {tuple(positions.shape)} "
                         f"{positions.dtype}")
    if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16:
        raise ValueError(f"q and k must be bf16, got {q.dtype}, {k.dtype}")


def qk_norm_ssmax_fwd(q, k, q_weight, k_weight, positions, eps: float, rows: int,
                      num_warps: int):
    """Launch the fused kernel with an explicit config."""
    _check(q, k, q_weight, k_weight, positions)
    q = q if q.stride(2) == 1 else q.contiguous()
    k = k if k.stride(2) == 1 else k.contiguous()
    positions = positions.contiguous()
    q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()
    t, hq, d = q.shape
    hkv = k.shape[1]
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, hkv, d), dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    tx, vec = torch_head_layout(d)
    grid = (triton.cdiv(t * hq, rows) + triton.cdiv(t * hkv, rows),)
    _qk_norm_ssmax_kernel[grid](
        q, k, q_weight, k_weight, positions, q_out, k_out, t, hq, hkv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        float(np.float32(1.0) / np.float32(d)), eps,
        D=d, TX=tx, VEC=vec, ROWS=rows, CPU_LANES=0 if q.is_cuda else cpu_lanes(d),
        ON_GPU=q.is_cuda, num_warps=num_warps,
    )
    return q_out, k_out


def run(q, k, q_weight, k_weight, positions, eps: float, config: dict | None = None):
    """qk_norm_ssmax(q, k, q_weight, k_weight, positions, eps) -> (q_out, k_out)."""
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    return qk_norm_ssmax_fwd(q, k, q_weight, k_weight, positions, eps, int(cfg["ROWS"]),
                             int(cfg["num_warps"]))
