"""qk_norm_rope: per-head RMSNorm of q and k, neox RoPE, and the K/V cache write in one launch.

# {{HEADER}}

Formula (docs/numerics.md "Q/K norm then RoPE"), per head row x[D] with its own weight w:
    n   = bf( f32(w) * ( f32(x) * rsqrt(mean(f32(x)^2) + eps) ) )        rounding 1
    out = bf( f32( f32(n * cos) + f32(rot(n) * sin) ) )                      rounding 2
with rot(n) = [-n[D/2:], n[:D/2]] and FP32 cos/sin tables [T, D]. Two separate products and an
add, never an FMA: on the GPU they are `mul_rn`/`add_rn`. The sum of squares follows torch's CUDA
order for a 128-wide row (32 lanes x 4 consecutive elements, combined ((a0+a1)+a2)+a3, then a
halving tree over the lanes); in the interpreter it follows torch's CPU order instead (AVX
vectors into four accumulators), so the CPU check is bitwise too. BF16 rounding is done on the
bit pattern (the interpreter's cast truncates). One program handles ROWS head rows of q or of k
(q rows first, then k rows); a k program writes its rows straight into the layer's KV cache at
the tokens' slots and copies the same rows of V there (bits), so the whole boundary, cache write
included, is one launch: decode (a few rows per rank) is launch-bound.
Memory traffic: read (Hq+2*Hkv)*T*D bf16 (+ the rotated half, an L1/L2 hit), 2*T*D fp32 tables
and T slots, write Hq*T*D bf16 (q) and 2*Hkv*T*D bf16 (the cache).
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


# {{rows.cpu_sum_inv_rms}}: _seq_sum, _cpu_row_sum_sq, _inv_rms


# {{rows.kv_write}}: _dest, _copy_v_rows, check_cache


@triton.jit
def _norm_rope_rows(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, slots_ptr, row0, n_rows, heads,
                    stride_t, stride_h, stride_cos, inv_n, eps,
                    D: tl.constexpr, TX: tl.constexpr, VEC: tl.constexpr, ROWS: tl.constexpr,
                    TO_CACHE: tl.constexpr, CPU_LANES: tl.constexpr, ON_GPU: tl.constexpr):
    rows = row0 + tl.arange(0, ROWS)
    rvalid = rows < n_rows
    rmask = rvalid[:, None]
    tok = (rows // heads).to(tl.int64)
    head = (rows % heads).to(tl.int64)
    cols = tl.arange(0, D)
    rot_cols = (cols + D // 2) % D
    base = x_ptr + (tok * stride_t + head * stride_h)[:, None]
    x = _bf16_to_f32(tl.load(base + cols[None, :], mask=rmask, other=0.0))
    xr = _bf16_to_f32(tl.load(base + rot_cols[None, :], mask=rmask, other=0.0))
    if CPU_LANES == 0:
        total = _row_sum_sq(x, ROWS, TX, VEC, ON_GPU)  # torch's CUDA order
    else:
        total = _cpu_row_sum_sq(x, ROWS, D, CPU_LANES)
    r = _inv_rms(total, inv_n, eps, ON_GPU)[:, None]
    w = _bf16_to_f32(tl.load(w_ptr + cols))[None, :]
    wr = _bf16_to_f32(tl.load(w_ptr + rot_cols))[None, :]
    n = _bf16_to_f32(_f32_to_bf16(_mul(w, _mul(x, r, ON_GPU), ON_GPU)))
    nr = _bf16_to_f32(_f32_to_bf16(_mul(wr, _mul(xr, r, ON_GPU), ON_GPU)))
    rot = tl.where((cols < D // 2)[None, :], -nr, nr)
    trow = (tok * stride_cos)[:, None] + cols[None, :]
    c = tl.load(cos_ptr + trow, mask=rmask, other=0.0)
    s = tl.load(sin_ptr + trow, mask=rmask, other=0.0)
    y = _add(_mul(n, c, ON_GPU), _mul(rot, s, ON_GPU), ON_GPU)
    dst = _dest(rows, rvalid, heads, slots_ptr, D, TO_CACHE)
    tl.store(out_ptr + dst[:, None] + cols[None, :], _f32_to_bf16(y), mask=rmask)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, qo_ptr, kc_ptr,
                         vc_ptr, slots_ptr, T, HQ, HKV, q_st, q_sh, k_st, k_sh, v_st, v_sh,
                         stride_cos, inv_n, eps,
                         D: tl.constexpr, TX: tl.constexpr, VEC: tl.constexpr,
                         ROWS: tl.constexpr, CPU_LANES: tl.constexpr,
                         ON_GPU: tl.constexpr):
    pid = tl.program_id(0)
    q_programs = tl.cdiv(T * HQ, ROWS)
    if pid < q_programs:
        _norm_rope_rows(q_ptr, qw_ptr, cos_ptr, sin_ptr, qo_ptr, slots_ptr, pid * ROWS, T * HQ,
                        HQ, q_st, q_sh, stride_cos, inv_n, eps, D, TX, VEC, ROWS, False,
                        CPU_LANES, ON_GPU)
    else:
        row0 = (pid - q_programs) * ROWS
        _norm_rope_rows(k_ptr, kw_ptr, cos_ptr, sin_ptr, kc_ptr, slots_ptr, row0, T * HKV, HKV,
                        k_st, k_sh, stride_cos, inv_n, eps, D, TX, VEC, ROWS, True, CPU_LANES,
                        ON_GPU)
        _copy_v_rows(v_ptr, vc_ptr, slots_ptr, row0, T * HKV, HKV, v_st, v_sh, D, ROWS)


# {{rows.layout}}: cpu_lanes, torch_head_layout


def _check(q, k, q_weight, k_weight, cos, sin) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"qk_norm_rope expects q[T,Hq,D], k[T,Hkv,D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}")
    t, _, d = q.shape
    if d & (d - 1) or d < 2:
        raise ValueError(f"head_dim {d} must be a power of two for this template")
    if tuple(q_weight.shape) != (d,) or tuple(k_weight.shape) != (d,):
        raise ValueError(f"q_weight/k_weight must be [{d}]")
    if tuple(cos.shape) != (t, d) or tuple(sin.shape) != (t, d) or cos.dtype != torch.float32:
        raise ValueError(f"cos/sin must be FP32 [{t}, {d}]; got {tuple(cos.shape)} {cos.dtype}")
    if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16:
        raise ValueError(f"q and k must be bf16, got {q.dtype}, {k.dtype}")


def qk_norm_rope_fwd(q, k, v, q_weight, k_weight, cos, sin, eps: float, k_cache, v_cache,
                     slots, rows: int, num_warps: int):
    """Launch the fused kernel with an explicit config; k_cache/v_cache are written in place."""
    _check(q, k, q_weight, k_weight, cos, sin)
    q = q if q.stride(2) == 1 else q.contiguous()
    k = k if k.stride(2) == 1 else k.contiguous()
    v = v if v.stride(2) == 1 else v.contiguous()
    check_cache(k, v, k_cache, v_cache, slots)
    cos, sin, slots = cos.contiguous(), sin.contiguous(), slots.contiguous()
    q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()
    t, hq, d = q.shape
    hkv = k.shape[1]
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return q_out, k_cache, v_cache
    tx, vec = torch_head_layout(d)
    grid = (triton.cdiv(t * hq, rows) + triton.cdiv(t * hkv, rows),)
    _qk_norm_rope_kernel[grid](
        q, k, v, q_weight, k_weight, cos, sin, q_out, k_cache, v_cache, slots, t, hq, hkv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), float(np.float32(1.0) / np.float32(d)), eps,
        D=d, TX=tx, VEC=vec, ROWS=rows, CPU_LANES=0 if q.is_cuda else cpu_lanes(d),
        ON_GPU=q.is_cuda, num_warps=num_warps,
    )
    return q_out, k_cache, v_cache


def run(q, k, v, q_weight, k_weight, cos, sin, eps: float, k_cache, v_cache, slots,
        config: dict | None = None):
    """qk_norm_rope(...) -> (q_out, k_cache, v_cache); the cache is updated in place."""
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    return qk_norm_rope_fwd(q, k, v, q_weight, k_weight, cos, sin, eps, k_cache, v_cache, slots,
                            int(cfg["ROWS"]), int(cfg["num_warps"]))
