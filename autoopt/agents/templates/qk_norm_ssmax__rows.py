"""qk_norm_ssmax: per-head RMSNorm of q and k, the SSMax query scale and the K/V cache write in one
launch.

# {{HEADER}}

Formula (docs/numerics.md "Q/K norm then SSMax"), per head row x[D] with its own weight w:
    n   = bf( f32(w) * ( f32(x) * rsqrt(mean(f32(x)^2) + eps) ) )        rounding 1 (q and k)
    tau = exp(0.1 * log1p((pos + 1) / 2048))                               FP32, per token
    q'  = bf( f32(n) * tau )                                               rounding 2 (q only)
exp/log1p (never pow), and tau is not folded into the softmax scale. On the GPU exp/log1p are
libdevice's (the functions torch's CUDA kernels call); the interpreter has neither libdevice nor
log1p, so there both are evaluated in FP64 and rounded, within the op's ulp(1) policy. The sum
of squares follows torch's CUDA order for the head row (32 lanes x 4 consecutive elements for
D = 128, then a halving tree), and torch's CPU order (AVX vectors into four accumulators) in
the interpreter. BF16 rounding is done on the bit pattern (the
interpreter's cast truncates). One program handles ROWS head rows of q or of k; a k program
writes its rows straight into the layer's KV cache at the tokens' slots and copies the same rows
of V there (bits): one launch, cache write included.
Memory traffic: read (Hq+2*Hkv)*T*D bf16 + T int64 positions and slots, write Hq*T*D bf16 (q)
and 2*Hkv*T*D bf16 (the cache).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

CONFIG_SPACE = {"ROWS": [1, 2, 4, 8, 16], "num_warps": [1, 2, 4, 8]}
DEFAULT_CONFIG = {"ROWS": 4, "num_warps": 4}


# {{common.bf16_to_f32}}: _bf16_to_f32


# {{common.f32_to_bf16}}: _f32_to_bf16


# {{rows.cuda_sum}}: _mul, _add, _halve, _row_sum_sq


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


# {{rows.cpu_sum_inv_rms}}: _seq_sum, _cpu_row_sum_sq, _inv_rms


# {{rows.kv_write}}: _dest, _copy_v_rows, check_cache


@triton.jit
def _norm_ssmax_rows(x_ptr, w_ptr, pos_ptr, out_ptr, slots_ptr, row0, n_rows, heads, stride_t,
                     stride_h, inv_n, eps, D: tl.constexpr, TX: tl.constexpr, VEC: tl.constexpr,
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
    # The scaled rows are q (token-major), the unscaled ones k (into the cache at their slots).
    dst = _dest(rows, rvalid, heads, slots_ptr, D, not SCALE)
    tl.store(out_ptr + dst[:, None] + cols[None, :], y, mask=rmask)


@triton.jit
def _qk_norm_ssmax_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, pos_ptr, qo_ptr, kc_ptr, vc_ptr,
                          slots_ptr, T, HQ, HKV, q_st, q_sh, k_st, k_sh, v_st, v_sh, inv_n, eps,
                          D: tl.constexpr, TX: tl.constexpr, VEC: tl.constexpr,
                          ROWS: tl.constexpr, CPU_LANES: tl.constexpr,
                          ON_GPU: tl.constexpr):
    pid = tl.program_id(0)
    q_programs = tl.cdiv(T * HQ, ROWS)
    if pid < q_programs:
        _norm_ssmax_rows(q_ptr, qw_ptr, pos_ptr, qo_ptr, slots_ptr, pid * ROWS, T * HQ, HQ,
                         q_st, q_sh, inv_n, eps, D, TX, VEC, ROWS, True, CPU_LANES, ON_GPU)
    else:
        row0 = (pid - q_programs) * ROWS
        _norm_ssmax_rows(k_ptr, kw_ptr, pos_ptr, kc_ptr, slots_ptr, row0, T * HKV, HKV, k_st,
                         k_sh, inv_n, eps, D, TX, VEC, ROWS, False, CPU_LANES, ON_GPU)
        _copy_v_rows(v_ptr, vc_ptr, slots_ptr, row0, T * HKV, HKV, v_st, v_sh, D, ROWS)


# {{rows.layout}}: cpu_lanes, torch_head_layout


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


def qk_norm_ssmax_fwd(q, k, v, q_weight, k_weight, positions, eps: float, k_cache, v_cache,
                      slots, rows: int, num_warps: int):
    """Launch the fused kernel with an explicit config; k_cache/v_cache are written in place."""
    _check(q, k, q_weight, k_weight, positions)
    q = q if q.stride(2) == 1 else q.contiguous()
    k = k if k.stride(2) == 1 else k.contiguous()
    v = v if v.stride(2) == 1 else v.contiguous()
    check_cache(k, v, k_cache, v_cache, slots)
    positions, slots = positions.contiguous(), slots.contiguous()
    q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()
    t, hq, d = q.shape
    hkv = k.shape[1]
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return q_out, k_cache, v_cache
    tx, vec = torch_head_layout(d)
    grid = (triton.cdiv(t * hq, rows) + triton.cdiv(t * hkv, rows),)
    _qk_norm_ssmax_kernel[grid](
        q, k, v, q_weight, k_weight, positions, q_out, k_cache, v_cache, slots, t, hq, hkv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        float(np.float32(1.0) / np.float32(d)), eps,
        D=d, TX=tx, VEC=vec, ROWS=rows, CPU_LANES=0 if q.is_cuda else cpu_lanes(d),
        ON_GPU=q.is_cuda, num_warps=num_warps,
    )
    return q_out, k_cache, v_cache


def run(q, k, v, q_weight, k_weight, positions, eps: float, k_cache, v_cache, slots,
        config: dict | None = None):
    """qk_norm_ssmax(...) -> (q_out, k_cache, v_cache); the cache is updated in place."""
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    return qk_norm_ssmax_fwd(q, k, v, q_weight, k_weight, positions, eps, k_cache, v_cache,
                             slots, int(cfg["ROWS"]), int(cfg["num_warps"]))
