"""moe_experts triton_v3 (hand-written): triton_v2, kernel A a register GEMV at one or two tokens.

At T = 1 triton_v2's kernel A (the tl.dot path, one x row padded to 16) reads its 52 MB at
~2.3 TB/s on an H200, its warps waiting on shared memory (Nsight Compute: L1/TEX 79% busy, 5 CTAs
an SM), while a plain Triton read of the same bytes runs at 3.8 TB/s. PATH "gemv" (the T = 1 and
2 buckets) runs kernel A as that read does: each program owns one (token, expert) pair and a tile
of BLOCK_N gate rows and their up rows over one K range, loads [2*BLOCK_N, BLOCK_K] weight tiles
straight into registers (16-byte loads, every step of the range issued at once, no shared
memory), multiplies by x's row and sums K at the end (split-K partials as in the decode path).
Pairs sharing an expert each read its rows (at one or two tokens, rare; the second read is
mostly L2). Kernel B, the rounding points and the combine are triton_v2's.

triton_v2 (below) is triton_v1 with the grouped path's sort in one launch:

triton_v1's grouped path (T >= 64 at decode) sorted the pairs by expert with ~20 small torch
launches (argsort, scatter_add, two cumsums, casts): 26 kernels a call on an H200 at bs 64.
Here one program does the same counting sort (`_align_kernel`: per-expert counts, their
prefix sums, each pair's stable place) when T*k <= ALIGN_MAX_PAIRS; the rest is triton_v1's.

Formula (docs/numerics.md "MoE combine", "SwiGLU"), per (token t, slot j), e = ids[t,j] - offset:
    gu  = bf( x[t] @ gate_up[e]^T )                        FP32 accumulation, one rounding
    a   = bf( f32(gu[:I]) / (1 + expf(-f32(gu[:I]))) * f32(gu[I:]) )     torch's silu, one rounding
    d_j = bf( a @ down[e]^T )                              FP32 accumulation, one rounding
    s_j = f32(d_j) * w[t,j]  (mul_rn, never an FMA)        0 for experts not held (e outside [0,E))
    y   = bf( sum_j s_j )   on CUDA (((s0+s4)+(s1+s5))+(s2+s6))+(s3+s7) (torch's four-accumulator
                            thread reduce: slot j into accumulator j % 4, then ((a0+a1)+a2)+a3);
                            on CPU left to right, as torch sums there
    out = bf( f32(y) * scale )
Rounding points gu, a, d_j, y and out are explicit round-to-nearest-even on the bit pattern (the
Triton interpreter's BF16 cast truncates); exp is libdevice's expf on the GPU and FP64-rounded in
the interpreter; the divide is div_rn. The GEMMs' K order differs from cuBLAS (the op's ulp policy);
split-K adds SPLIT_K partial sums in FP32, another K order within the same policy.

Paths (config "PATH"):
  decode  (T*k pairs <= 1024): no sort. Kernel A runs over (pair, N-tile of I, K-split): an
          expert's pairs (found by a scan of the ids) are cut into row blocks of BLOCK_M, each
          owned by the pair that opens it, which computes their gate|up tile (one weight tile of
          BLOCK_N gate rows and the matching up rows, cp.async-pipelined 16-byte loads; tl.dot
          with rows padded to 16, or multiply-reduce for a row or two: config MMA), SwiGLU in
          the epilogue, into act[T*k, I]; other pairs exit, so each hit expert's gate_up is
          streamed once (row blocks of one expert run side by side and share it through L2).
          With SPLIT_K > 1 (T = 1..4: too few experts to fill the SMs) each CTA sums one range
          of K into an FP32 partial; the last split of a tile adds the partials in split order
          (deterministic) and runs the epilogue, then resets the tile's counter (a reused,
          self-cleaning buffer: no memset per call). Kernel B runs over (token, H-tile),
          tokens fastest so tokens sharing an expert read its down tile from L2: one gather of
          all k slots' down rows per I-chunk, the GEMVs (K = I), weights, combine in order,
          rounding, scale. Two launches; with config PDL, B is a programmatic dependent launch
          of A, and with PREFETCH it pulls its down rows into L2 before waiting for A's act.
  grouped (any T): pairs sorted by expert on the device (one `_align_kernel` program up to
          ALIGN_MAX_PAIRS pairs, else argsort, counts, cumsum; no host sync either way),
          expert row tiles of BLOCK_M mapped to programs through the tile offsets; tl.dot tiles
          for gate_up+SwiGLU and for down (d rows into a scratch), then a combine kernel.
Memory traffic: read the hit experts' weights once (3*I*H bf16 each), x and act (L2), write
T*H bf16 (+ T*k*I bf16 act; split-K also SPLIT_K*T*k*2I fp32 partials, L2; grouped also T*k*H
bf16 d).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

try:  # programmatic dependent launch (sm_90+); absent from older Tritons, never traced then
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    gdc_launch_dependents = gdc_wait = None

LANGUAGE = "triton"
CONFIG_SPACE = {
    "PATH": ["decode", "grouped", "gemv"],
    "MMA": [True, False],  # decode kernel A: tl.dot (BLOCK_M >= 16) or multiply-reduce
    "BLOCK_M": [1, 2, 4, 16, 32, 64, 128],
    "BLOCK_N": [4, 8, 16, 32, 64],
    "BLOCK_K": [64, 128, 256, 512, 1024],
    "A_WARPS": [2, 4, 8],
    "A_STAGES": [1, 2, 3, 4, 5],
    # Decode kernel A: K = H cut into SPLIT_K ranges, one CTA each, so a few experts' tiles
    # fill the SMs at T = 1..4 (FP32 partials, the last split of a tile adds them in order).
    "SPLIT_K": [1, 2, 4, 8],
    "BLOCK_H": [4, 8, 16, 32, 64, 128],
    "BLOCK_I": [32, 64, 128],
    "B_WARPS": [2, 4, 8],
    "B_STAGES": [1, 2, 3, 4],
    # Kernel B launched as a programmatic dependent of A: its CTAs start (ids, weights, pointers)
    # while A drains and wait for A's act at griddepcontrol.wait. GPU only.
    "PDL": [False, True],
    # With PDL: kernel B prefetches its down rows into L2 before waiting for A (GPU only).
    "PREFETCH": [False, True],
}
# Unset keys follow the token bucket (BUCKET_DEFAULTS: the largest bucket <= T); the CPU
# (interpreter) takes coarse tiles, since there every program is a Python loop.
DEFAULT_CONFIG: dict = {}
BUCKET_DEFAULTS = {  # the fastest correct config of each bucket on an H200 (GPU sweep)
    1: {"PATH": "gemv", "MMA": False, "BLOCK_M": 1, "BLOCK_N": 4, "BLOCK_K": 512,
        "A_WARPS": 4, "A_STAGES": 1, "SPLIT_K": 2, "BLOCK_H": 8, "BLOCK_I": 64, "B_WARPS": 4,
        "B_STAGES": 3, "PDL": False, "PREFETCH": False},
    2: {"PATH": "gemv", "MMA": False, "BLOCK_M": 1, "BLOCK_N": 4, "BLOCK_K": 512,
        "A_WARPS": 4, "A_STAGES": 1, "SPLIT_K": 2, "BLOCK_H": 8, "BLOCK_I": 64, "B_WARPS": 4,
        "B_STAGES": 3, "PDL": False, "PREFETCH": False},
    4: {"PATH": "decode", "MMA": True, "BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 128,
        "A_WARPS": 4, "A_STAGES": 4, "SPLIT_K": 2, "BLOCK_H": 8, "BLOCK_I": 64, "B_WARPS": 4,
        "B_STAGES": 3, "PDL": False, "PREFETCH": False},
    8: {"PATH": "decode", "MMA": True, "BLOCK_M": 16, "BLOCK_N": 8, "BLOCK_K": 128,
        "A_WARPS": 2, "A_STAGES": 4, "SPLIT_K": 1, "BLOCK_H": 8, "BLOCK_I": 64, "B_WARPS": 4,
        "B_STAGES": 3, "PDL": False, "PREFETCH": False},
    16: {"PATH": "decode", "MMA": True, "BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 128,
         "A_WARPS": 4, "A_STAGES": 4, "SPLIT_K": 1, "BLOCK_H": 8, "BLOCK_I": 64, "B_WARPS": 4,
         "B_STAGES": 3, "PDL": False, "PREFETCH": False},
    32: {"PATH": "decode", "MMA": True, "BLOCK_M": 16, "BLOCK_N": 8, "BLOCK_K": 256,
         "A_WARPS": 4, "A_STAGES": 4, "SPLIT_K": 1, "BLOCK_H": 8, "BLOCK_I": 64, "B_WARPS": 4,
         "B_STAGES": 3, "PDL": False, "PREFETCH": False},
    64: {"PATH": "grouped", "MMA": True, "BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 128,
         "A_WARPS": 4, "A_STAGES": 4, "SPLIT_K": 1, "BLOCK_H": 32, "BLOCK_I": 64, "B_WARPS": 4,
         "B_STAGES": 3, "PDL": False, "PREFETCH": False},
    128: {"PATH": "grouped", "MMA": True, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64,
          "A_WARPS": 8, "A_STAGES": 3, "SPLIT_K": 1, "BLOCK_H": 128, "BLOCK_I": 64,
          "B_WARPS": 8, "B_STAGES": 3, "PDL": False, "PREFETCH": False},
}
CPU_TILES = {"BLOCK_N": 64, "BLOCK_K": 128, "BLOCK_H": 128}
DECODE_MAX_PAIRS = 1024  # the decode path scans all T*k ids per program
GEMV_MAX_STEPS = 32  # the gemv path unrolls its K range; longer ranges take the decode kernel
ALIGN_MAX_PAIRS = 4096  # one program sorts up to this many pairs; torch's sort above
ALIGN_BLOCK = 64  # pairs per step of that program ([ALIGN_BLOCK, E] and [ALIGN_BLOCK]^2 tiles)


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
def _round(x):
    return _bf16_to_f32(_f32_to_bf16(x))


@triton.jit
def _exp(x, ON_GPU: tl.constexpr):
    if ON_GPU:
        return libdevice.exp(x)  # __nv_expf, the expf torch's CUDA kernels call
    else:
        return tl.exp(x.to(tl.float64)).to(tl.float32)


@triton.jit
def _mul(a, b, ON_GPU: tl.constexpr):
    if ON_GPU:
        return libdevice.mul_rn(a, b)  # a separately rounded product, never fused into an add
    else:
        return a * b


@triton.jit
def _dot(a, b, acc, ON_GPU: tl.constexpr):
    # acc + a @ b^T, bf16 operands, FP32 accumulation. The interpreter's bf16 tl.dot reads the
    # bits wrongly: there the operands are widened exactly and multiplied in IEEE FP32.
    if ON_GPU:
        return tl.dot(a, tl.trans(b), acc)
    else:
        return tl.dot(_bf16_to_f32(a), tl.trans(_bf16_to_f32(b)), acc, input_precision="ieee")


@triton.jit
def _combine_add(a0, a1, a2, a3, s, j: tl.constexpr, ON_GPU: tl.constexpr):
    # Slot j's weighted output into torch's accumulator (CUDA: j % 4; CPU: one, left to right).
    if ON_GPU:
        if j % 4 == 0:
            a0 = a0 + s
        elif j % 4 == 1:
            a1 = a1 + s
        elif j % 4 == 2:
            a2 = a2 + s
        else:
            a3 = a3 + s
    else:
        a0 = a0 + s
    return a0, a1, a2, a3


@triton.jit
def _combine_slots(s, js, K_TOP: tl.constexpr, BLOCK_H: tl.constexpr, ON_GPU: tl.constexpr):
    # s [K2, BLOCK_H] -> the FP32 slot sum in torch's order. Row j is picked exactly (s_j plus
    # zeros); unused accumulators stay +0, so ((a0+a1)+a2)+a3 is exact on the CPU path too.
    a0 = tl.zeros([BLOCK_H], dtype=tl.float32)
    a1 = tl.zeros([BLOCK_H], dtype=tl.float32)
    a2 = tl.zeros([BLOCK_H], dtype=tl.float32)
    a3 = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(K_TOP):
        sj = tl.sum(tl.where(js[:, None] == j, s, 0.0), axis=0)
        a0, a1, a2, a3 = _combine_add(a0, a1, a2, a3, sj, j, ON_GPU)
    return ((a0 + a1) + a2) + a3


@triton.jit
def _store_scaled(out_ptr, y, scale, hmask, ON_GPU: tl.constexpr):
    tl.store(out_ptr, _f32_to_bf16(_mul(_round(y), scale, ON_GPU)), mask=hmask)


@triton.jit
def _gate_up_acc(x_ptr, w_ptr, pairs, pmask, n0, k_lo, k_hi, H, N_INTER, stride_x, stride_wn,
                 K_TOP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, MMA: tl.constexpr,
                 STAGES: tl.constexpr, ON_GPU: tl.constexpr):
    # FP32 [BLOCK_M, 2*BLOCK_N] = x[pairs] @ (gate rows n0.. | up rows I+n0..)^T over K in
    # [k_lo, k_hi) of one expert (w_ptr at its gate_up[e]): one weight tile of 2*BLOCK_N rows, so
    # a single dot (N = 2*BLOCK_N >= 16) serves both halves.
    rk = tl.arange(0, BLOCK_K)
    r2 = tl.arange(0, 2 * BLOCK_N)
    rn = n0 + r2 % BLOCK_N
    nmask = rn < N_INTER
    x_rows = x_ptr + (pairs // K_TOP).to(tl.int64)[:, None] * stride_x + rk[None, :]
    w_rows = w_ptr + (rn + (r2 // BLOCK_N) * N_INTER).to(tl.int64)[:, None] * stride_wn \
        + rk[None, :]
    if MMA:
        acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, 2 * BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        if EVEN_K:
            xm = pmask[:, None]
            wm = nmask[:, None]
        else:
            xm = pmask[:, None] & (k0 + rk < H)[None, :]
            wm = nmask[:, None] & (k0 + rk < H)[None, :]
        xa = tl.load(x_rows + k0, mask=xm, other=0.0)
        w = tl.load(w_rows + k0, mask=wm, other=0.0)
        if MMA:
            acc = _dot(xa, w, acc, ON_GPU)
        else:  # bf16 x bf16 products are exact in FP32: an FMA here rounds like mul + add
            acc += _bf16_to_f32(xa)[:, None, :] * _bf16_to_f32(w)[None, :, :]
    if not MMA:
        acc = tl.sum(acc, axis=2)
    return acc


@triton.jit
def _swiglu_store(acc, act_ptr, pairs, pmask, n0, N_INTER, stride_act, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, ON_GPU: tl.constexpr):
    # act[pairs, n0:n0+BLOCK_N] = bf(silu(bf(gate)) * bf(up)) from the FP32 [gate | up] sums.
    gate, up = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, BLOCK_N]), [0, 2, 1]))
    g = _round(gate)
    silu = tl.div_rn(g, 1.0 + _exp(-g, ON_GPU))
    a = _f32_to_bf16(silu * _round(up))
    rn = n0 + tl.arange(0, BLOCK_N)
    dst = act_ptr + pairs.to(tl.int64)[:, None] * stride_act + rn[None, :]
    tl.store(dst, a, mask=pmask[:, None] & (rn < N_INTER)[None, :])


@triton.jit
def _gate_up_swiglu_tile(x_ptr, w_ptr, act_ptr, pairs, pmask, n0, H, N_INTER, stride_x, stride_wn,
                         stride_act, K_TOP: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                         MMA: tl.constexpr, STAGES: tl.constexpr, ON_GPU: tl.constexpr):
    acc = _gate_up_acc(x_ptr, w_ptr, pairs, pmask, n0, 0, H, H, N_INTER, stride_x, stride_wn,
                       K_TOP, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, MMA, STAGES, ON_GPU)
    _swiglu_store(acc, act_ptr, pairs, pmask, n0, N_INTER, stride_act, BLOCK_M, BLOCK_N, ON_GPU)


@triton.jit
def _split_k_finish(acc, ws_ptr, cnt_ptr, act_ptr, pairs, pmask, n0, split, P, N_INTER,
                    stride_act, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, ON_GPU: tl.constexpr):
    # Split-K: each split stores its FP32 partial [gate | up] rows into ws[split, pair, 2I]; the
    # split that arrives last at this tile's counter adds the SPLIT_K partials in split order
    # (((p0 + p1) + p2) + ...: the same sums whoever arrives last, so the call is deterministic),
    # rounds and runs the SwiGLU, and resets the counter to 0 for the next call. The stores are
    # released by the CTA barrier and the counter's acq_rel atomic (CUTLASS's semaphore pattern).
    r2 = tl.arange(0, 2 * BLOCK_N)
    cols = n0 + r2 % BLOCK_N + (r2 // BLOCK_N) * N_INTER
    m2 = pmask[:, None] & ((n0 + r2 % BLOCK_N) < N_INTER)[None, :]
    rows = pairs.to(tl.int64)[:, None] * (2 * N_INTER) + cols[None, :]
    tl.store(ws_ptr + split.to(tl.int64) * P * (2 * N_INTER) + rows, acc, mask=m2)
    tl.debug_barrier()
    if tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1:
        total = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            total += tl.load(ws_ptr + s * P * (2 * N_INTER) + rows, mask=m2, other=0.0,
                             cache_modifier=".cg")
        tl.atomic_xchg(cnt_ptr, 0, sem="relaxed", scope="gpu")
        _swiglu_store(total, act_ptr, pairs, pmask, n0, N_INTER, stride_act, BLOCK_M, BLOCK_N,
                      ON_GPU)


@triton.jit
def _moe_experts_gate_up_decode_kernel(
    x_ptr, ids_ptr, w_ptr, act_ptr, ws_ptr, cnt_ptr, P, E, offset, H, N_INTER, K_SPLIT, stride_x,
    stride_we, stride_wn, stride_act, K_TOP: tl.constexpr, P2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    MMA: tl.constexpr, STAGES: tl.constexpr, SPLIT_K: tl.constexpr, ON_GPU: tl.constexpr,
    PDL: tl.constexpr,
):
    if PDL:
        gdc_launch_dependents()  # kernel B may be scheduled as A's CTAs retire
    p = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    split = tl.program_id(2)
    q = tl.arange(0, P2)
    local = tl.load(ids_ptr + q, mask=q < P, other=0) - offset
    held = (q < P) & (local >= 0) & (local < E)
    e = tl.sum(tl.where(q == p, local, 0))
    same = held & (local == e)
    rank = tl.cumsum(same.to(tl.int32), 0) - 1  # each pair's place among its expert's pairs
    mine = tl.sum(tl.where(same & (q == p), rank + 1, 0)) - 1  # -1: p is not held here
    # The pairs of an expert in row blocks of BLOCK_M, each block owned by the pair that opens
    # it: every block of a hot expert runs in its own CTA (all CTAs of one N-tile are adjacent in
    # launch order, so the blocks share the expert's weight tile through L2).
    if (mine >= 0) & (mine % BLOCK_M == 0):
        count = tl.sum(same.to(tl.int32))
        rm = mine + tl.arange(0, BLOCK_M)
        pick = same[None, :] & (rank[None, :] == rm[:, None])
        pairs = tl.sum(tl.where(pick, q[None, :], 0), axis=1)
        pmask = rm < count
        w_e = w_ptr + e.to(tl.int64) * stride_we
        if SPLIT_K == 1:
            _gate_up_swiglu_tile(x_ptr, w_e, act_ptr, pairs, pmask, n0, H, N_INTER, stride_x,
                                 stride_wn, stride_act, K_TOP, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                                 MMA, STAGES, ON_GPU)
        else:
            k_lo = split * K_SPLIT
            acc = _gate_up_acc(x_ptr, w_e, pairs, pmask, n0, k_lo, tl.minimum(k_lo + K_SPLIT, H),
                               H, N_INTER, stride_x, stride_wn, K_TOP, BLOCK_M, BLOCK_N, BLOCK_K,
                               EVEN_K, MMA, STAGES, ON_GPU)
            cnt = cnt_ptr + p * tl.num_programs(1) + tl.program_id(1)
            _split_k_finish(acc, ws_ptr, cnt, act_ptr, pairs, pmask, n0, split, P, N_INTER,
                            stride_act, SPLIT_K, BLOCK_M, BLOCK_N, ON_GPU)


@triton.jit
def _moe_experts_gate_up_gemv_kernel(
    x_ptr, ids_ptr, w_ptr, act_ptr, ws_ptr, cnt_ptr, P, E, offset, H, N_INTER, K_SPLIT, stride_x,
    stride_we, stride_wn, stride_act, K_TOP: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, STEPS: tl.constexpr, SPLIT_K: tl.constexpr, ON_GPU: tl.constexpr,
):
    # Program (pair p, N-tile, K range): act[p, n0:n0+BLOCK_N] from gate rows n0.. and up rows
    # I+n0.. of p's expert. Per-element FP32 products accumulate over the range's steps, then K
    # is summed once; with SPLIT_K > 1 the last split adds the partials in split order.
    p = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    split = tl.program_id(2)
    e = tl.load(ids_ptr + p) - offset
    if (e >= 0) & (e < E):
        rk = tl.arange(0, BLOCK_K)
        r2 = tl.arange(0, 2 * BLOCK_N)
        rn = n0 + r2 % BLOCK_N
        nmask = rn < N_INTER
        w_rows = w_ptr + e.to(tl.int64) * stride_we \
            + (rn + (r2 // BLOCK_N) * N_INTER).to(tl.int64)[:, None] * stride_wn + rk[None, :]
        x_row = x_ptr + (p // K_TOP).to(tl.int64) * stride_x + rk
        k_lo = split * K_SPLIT
        k_hi = tl.minimum(k_lo + K_SPLIT, H)
        acc = tl.zeros([2 * BLOCK_N, BLOCK_K], dtype=tl.float32)
        for step in tl.static_range(STEPS):  # unrolled: every step's loads in flight at once
            k0 = k_lo + step * BLOCK_K
            km = k0 + rk < k_hi
            xk = _bf16_to_f32(tl.load(x_row + k0, mask=km, other=0.0))
            w = _bf16_to_f32(tl.load(w_rows + k0, mask=nmask[:, None] & km[None, :], other=0.0))
            acc += w * xk[None, :]  # bf16 x bf16 is exact in FP32: FMA or not, the same sums
        gu = tl.reshape(tl.sum(acc, axis=1), [1, 2 * BLOCK_N])
        pairs = p + tl.arange(0, 1)
        pmask = pairs < P
        if SPLIT_K == 1:
            _swiglu_store(gu, act_ptr, pairs, pmask, n0, N_INTER, stride_act, 1, BLOCK_N, ON_GPU)
        else:
            cnt = cnt_ptr + p * tl.num_programs(1) + tl.program_id(1)
            _split_k_finish(gu, ws_ptr, cnt, act_ptr, pairs, pmask, n0, split, P, N_INTER,
                            stride_act, SPLIT_K, 1, BLOCK_N, ON_GPU)


@triton.jit
def _prefetch_down(w_ptr, local, held, rh, H, N_INTER, stride_we, stride_wh, K2: tl.constexpr,
                   BLOCK_H: tl.constexpr, I_LINES: tl.constexpr):
    # One L2 prefetch per 128-byte line of this CTA's k down tiles [BLOCK_H, I] (GPU only; lines
    # past the tile clamp to its last element, slots held elsewhere to expert 0: in bounds).
    line = tl.minimum(tl.arange(0, I_LINES) * 64, N_INTER - 1)
    rows = tl.where(held, local, 0).to(tl.int64)[:, None, None] * stride_we \
        + tl.minimum(rh, H - 1).to(tl.int64)[None, :, None] * stride_wh + line[None, None, :]
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                              [w_ptr + rows], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _moe_experts_down_combine_kernel(
    act_ptr, w_ptr, weights_ptr, ids_ptr, out_ptr, E, offset, H, N_INTER, scale, stride_act,
    stride_we, stride_wh, stride_out, K_TOP: tl.constexpr, K2: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr, EVEN_I: tl.constexpr, STAGES: tl.constexpr,
    ON_GPU: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr, I_LINES: tl.constexpr,
):
    # All k slots of one token at once: each chunk is one [K2, BLOCK_H, BLOCK_I] gather of the k
    # experts' down rows, so every slot's bytes are in flight together.
    t = tl.program_id(0)
    rh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = rh < H
    js = tl.arange(0, K2)
    ri = tl.arange(0, BLOCK_I)
    local = tl.load(ids_ptr + t * K_TOP + js, mask=js < K_TOP, other=0) - offset
    held = (js < K_TOP) & (local >= 0) & (local < E)
    wvec = tl.load(weights_ptr + t * K_TOP + js, mask=js < K_TOP, other=0.0)
    w_rows = w_ptr + tl.where(held, local, 0).to(tl.int64)[:, None, None] * stride_we \
        + rh.to(tl.int64)[None, :, None] * stride_wh + ri[None, None, :]
    a_rows = act_ptr + (t * K_TOP + js).to(tl.int64)[:, None] * stride_act + ri[None, :]
    acc = tl.zeros([K2, BLOCK_H, BLOCK_I], dtype=tl.float32)
    if PDL:
        if PREFETCH:  # the down rows do not depend on A: pull them into L2 during A's tail
            _prefetch_down(w_ptr, local, held, rh, H, N_INTER, stride_we, stride_wh, K2, BLOCK_H,
                           I_LINES)
        gdc_wait()  # kernel A's act is complete and visible past this point
    for i0 in tl.range(0, N_INTER, BLOCK_I, num_stages=STAGES):
        if EVEN_I:
            am = held[:, None]
        else:
            am = held[:, None] & (i0 + ri < N_INTER)[None, :]
        a = _bf16_to_f32(tl.load(a_rows + i0, mask=am, other=0.0))
        w = tl.load(w_rows + i0, mask=am[:, None, :] & hmask[None, :, None], other=0.0)
        acc += _bf16_to_f32(w) * a[:, None, :]  # exact products: FMA or not, the same sums
    d = _round(tl.sum(acc, axis=2))
    y = _combine_slots(_mul(d, wvec[:, None], ON_GPU), js, K_TOP, BLOCK_H, ON_GPU)
    _store_scaled(out_ptr + t.to(tl.int64) * stride_out + rh, y, scale, hmask, ON_GPU)


@triton.jit
def _expert_tile(tile_end_ptr, counts_ptr, starts_ptr, tile, E, E2: tl.constexpr,
                 BLOCK_M: tl.constexpr):
    # (expert, first row in its sorted range, rows left) of grouped row tile `tile`; e == E: none.
    re = tl.arange(0, E2)
    ends = tl.load(tile_end_ptr + re, mask=re < E, other=2147483647)
    e = tl.sum((ends <= tile).to(tl.int32))
    ee = tl.minimum(e, E - 1)
    count = tl.load(counts_ptr + ee)
    first_tile = tl.load(tile_end_ptr + ee) - (count + BLOCK_M - 1) // BLOCK_M
    m0 = (tile - first_tile) * BLOCK_M
    return e, tl.load(starts_ptr + ee) + m0, count - m0


@triton.jit
def _moe_experts_gate_up_grouped_kernel(
    x_ptr, order_ptr, tile_end_ptr, counts_ptr, starts_ptr, w_ptr, act_ptr, E, H, N_INTER, stride_x,
    stride_we, stride_wn, stride_act, K_TOP: tl.constexpr, E2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    STAGES: tl.constexpr, ON_GPU: tl.constexpr,
):
    n0 = tl.program_id(0) * BLOCK_N
    e, row0, left = _expert_tile(tile_end_ptr, counts_ptr, starts_ptr, tl.program_id(1), E, E2,
                                 BLOCK_M)
    if e < E:
        rm = tl.arange(0, BLOCK_M)
        pmask = rm < left
        pairs = tl.load(order_ptr + row0 + rm, mask=pmask, other=0)
        _gate_up_swiglu_tile(x_ptr, w_ptr + e.to(tl.int64) * stride_we, act_ptr, pairs, pmask,
                             n0, H, N_INTER, stride_x, stride_wn, stride_act, K_TOP, BLOCK_M,
                             BLOCK_N, BLOCK_K, EVEN_K, True, STAGES, ON_GPU)


@triton.jit
def _moe_experts_down_grouped_kernel(
    act_ptr, order_ptr, tile_end_ptr, counts_ptr, starts_ptr, w_ptr, d_ptr, E, H, N_INTER,
    stride_act, stride_we, stride_wh, stride_d, E2: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr, STAGES: tl.constexpr, ON_GPU: tl.constexpr,
):
    rh = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    e, row0, left = _expert_tile(tile_end_ptr, counts_ptr, starts_ptr, tl.program_id(1), E, E2,
                                 BLOCK_M)
    if e < E:
        rm = tl.arange(0, BLOCK_M)
        ri = tl.arange(0, BLOCK_I)
        pmask = rm < left
        hmask = rh < H
        pairs = tl.load(order_ptr + row0 + rm, mask=pmask, other=0).to(tl.int64)
        a_rows = act_ptr + pairs[:, None] * stride_act + ri[None, :]
        w_rows = w_ptr + e.to(tl.int64) * stride_we + rh.to(tl.int64)[:, None] * stride_wh \
            + ri[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
        for i0 in tl.range(0, N_INTER, BLOCK_I, num_stages=STAGES):
            im = (i0 + ri < N_INTER)[None, :]
            a = tl.load(a_rows + i0, mask=pmask[:, None] & im, other=0.0)
            w = tl.load(w_rows + i0, mask=hmask[:, None] & im, other=0.0)
            acc = _dot(a, w, acc, ON_GPU)
        dst = d_ptr + pairs[:, None] * stride_d + rh[None, :]
        tl.store(dst, _f32_to_bf16(acc), mask=pmask[:, None] & hmask[None, :])


@triton.jit
def _moe_experts_combine_kernel(
    d_ptr, weights_ptr, ids_ptr, out_ptr, E, offset, H, scale, stride_d, stride_out,
    K_TOP: tl.constexpr, K2: tl.constexpr, BLOCK_H: tl.constexpr, ON_GPU: tl.constexpr,
):
    t = tl.program_id(0)
    rh = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = rh < H
    js = tl.arange(0, K2)
    local = tl.load(ids_ptr + t * K_TOP + js, mask=js < K_TOP, other=0) - offset
    held = (js < K_TOP) & (local >= 0) & (local < E)
    wvec = tl.load(weights_ptr + t * K_TOP + js, mask=js < K_TOP, other=0.0)
    rows = d_ptr + (t * K_TOP + js).to(tl.int64)[:, None] * stride_d + rh[None, :]
    d = _bf16_to_f32(tl.load(rows, mask=held[:, None] & hmask[None, :], other=0.0))
    y = _combine_slots(_mul(d, wvec[:, None], ON_GPU), js, K_TOP, BLOCK_H, ON_GPU)
    _store_scaled(out_ptr + t.to(tl.int64) * stride_out + rh, y, scale, hmask, ON_GPU)


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _check(x, gate_up, down, weights, ids) -> None:
    shapes = (f"x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}, "
              f"weights {tuple(weights.shape)}, ids {tuple(ids.shape)}")
    if x.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3 or ids.dim() != 2:
        raise ValueError(f"moe_experts expects x[T,H], gate_up[E,2I,H], down[E,H,I], "
                         f"weights[T,k], ids[T,k]; got {shapes}")
    (t, h), (e, i2, h2), k = x.shape, gate_up.shape, ids.shape[1]
    if h2 != h or i2 % 2 or down.shape != (e, h, i2 // 2) or weights.shape != (t, k) \
            or ids.shape[0] != t:
        raise ValueError(f"moe_experts shapes disagree: {shapes}")
    if any(a.dtype != torch.bfloat16 for a in (x, gate_up, down)):
        raise ValueError(f"moe_experts expects bf16 x, gate_up, down; got {x.dtype}, "
                         f"{gate_up.dtype}, {down.dtype}")
    if weights.dtype != torch.float32 or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"moe_experts expects fp32 weights and int64 ids; got {weights.dtype}, "
                         f"{ids.dtype}")
    if any(a.stride(-1) != 1 for a in (x, gate_up, down)):
        raise ValueError(f"moe_experts needs unit stride along the last dim ({shapes}): pass "
                         ".contiguous() tensors")
    if len({a.device for a in (x, gate_up, down, weights, ids)}) != 1:
        raise ValueError("moe_experts: all inputs must be on one device")


def _config(tokens: int, pairs: int, config: dict | None, on_gpu: bool) -> dict:
    base = BUCKET_DEFAULTS[max(b for b in BUCKET_DEFAULTS if b <= max(tokens, 1))]
    cfg = {**base, **({} if on_gpu else CPU_TILES), **(config or {})}
    if cfg["PATH"] == "decode" and pairs > DECODE_MAX_PAIRS:
        cfg = {**BUCKET_DEFAULTS[max(BUCKET_DEFAULTS)], **{k: v for k, v in cfg.items()
                                                           if k.endswith(("WARPS", "STAGES"))},
               "PATH": "grouped"}
    if cfg["PATH"] == "grouped" or cfg["MMA"]:
        # tl.dot needs 16 rows and 16 columns (2 * BLOCK_N: gate and up)
        cfg["BLOCK_M"], cfg["BLOCK_N"] = max(16, cfg["BLOCK_M"]), max(8, cfg["BLOCK_N"])
    return cfg


def moe_experts_decode(x, gate_up, down, weights, ids, scale, offset, out, cfg) -> None:
    """Kernel A (dedup scan, gate_up + SwiGLU into act; or per pair, the register GEMV) then
    kernel B (down + combine)."""
    (t, h), (e, i2, _), k = x.shape, gate_up.shape, ids.shape[1]
    i, p, on_gpu = i2 // 2, t * ids.shape[1], x.is_cuda
    pdl = bool(cfg.get("PDL")) and on_gpu and gdc_wait is not None
    act = torch.empty((p, i), dtype=x.dtype, device=x.device)
    ids = ids.contiguous()
    bk, n_tiles = cfg["BLOCK_K"], triton.cdiv(i, cfg["BLOCK_N"])
    split = max(1, min(int(cfg.get("SPLIT_K", 1)), triton.cdiv(h, bk)))
    k_split = triton.cdiv(triton.cdiv(h, split), bk) * bk  # whole BLOCK_K steps per split
    split = triton.cdiv(h, k_split)
    ws = torch.empty((split, p, i2) if split > 1 else (1,), dtype=torch.float32, device=x.device)
    cnt = split_counters(x.device, p * n_tiles)
    steps = triton.cdiv(k_split, bk)
    if cfg["PATH"] == "gemv" and steps <= GEMV_MAX_STEPS:
        _moe_experts_gate_up_gemv_kernel[(p, n_tiles, split)](
            x, ids, gate_up, act, ws, cnt, p, e, offset, h, i, k_split, x.stride(0),
            gate_up.stride(0), gate_up.stride(1), act.stride(0), K_TOP=k, BLOCK_N=cfg["BLOCK_N"],
            BLOCK_K=bk, STEPS=steps, SPLIT_K=split, ON_GPU=on_gpu, num_warps=cfg["A_WARPS"])
    else:
        _launch_decode_a(x, ids, gate_up, act, ws, cnt, p, e, offset, h, i, k_split, k, n_tiles,
                         split, bk, on_gpu, pdl, cfg)
    _launch_down(act, down, weights, ids, out, t, e, offset, h, i, k, scale, on_gpu, pdl, cfg)


def _launch_decode_a(x, ids, gate_up, act, ws, cnt, p, e, offset, h, i, k_split, k, n_tiles,
                     split, bk, on_gpu, pdl, cfg) -> None:
    _moe_experts_gate_up_decode_kernel[(p, n_tiles, split)](
        x, ids, gate_up, act, ws, cnt, p, e, offset, h, i, k_split, x.stride(0),
        gate_up.stride(0), gate_up.stride(1), act.stride(0), K_TOP=k, P2=max(64, _pow2(p)),
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=bk, EVEN_K=h % bk == 0,
        MMA=bool(cfg["MMA"]), STAGES=cfg["A_STAGES"], SPLIT_K=split, ON_GPU=on_gpu, PDL=pdl,
        num_warps=cfg["A_WARPS"])


def _launch_down(act, down, weights, ids, out, t, e, offset, h, i, k, scale, on_gpu, pdl,
                 cfg) -> None:
    block_i = min(cfg["BLOCK_I"], _pow2(i))
    _moe_experts_down_combine_kernel[(t, triton.cdiv(h, cfg["BLOCK_H"]))](
        act, down, weights.contiguous(), ids, out, e, offset, h, i, float(scale), act.stride(0),
        down.stride(0), down.stride(1), out.stride(0), K_TOP=k, K2=_pow2(k),
        BLOCK_H=cfg["BLOCK_H"], BLOCK_I=block_i, EVEN_I=i % block_i == 0,
        STAGES=cfg["B_STAGES"], ON_GPU=on_gpu, PDL=pdl, PREFETCH=bool(cfg.get("PREFETCH")),
        I_LINES=_pow2(triton.cdiv(i, 64)), num_warps=cfg["B_WARPS"],
        **({"launch_pdl": True} if pdl else {}))


_COUNTERS: dict = {}
_RETIRED: list = []


def split_counters(device: torch.device, n: int) -> torch.Tensor:
    """int32 zeros, >= n, that split-K's last CTAs reset after use: kept per device and reused,
    so a call (and a CUDA graph replay) costs no memset. Calls on one device must not overlap in
    time (one stream, as the decode step runs the layers). Inside a capture a new buffer comes
    from the graph's pool, and is kept: the graph replays on it."""
    key = (device.type, device.index)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1 << 17), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
        _RETIRED.append(buf)  # never freed: a captured graph may still point at an older one
    return buf


@triton.jit
def _align_kernel(ids_ptr, order_ptr, counts_ptr, starts_ptr, tile_end_ptr, P, E, offset,
                  E2: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr):
    # One program, `align`'s counting sort: pass 1 counts each held expert's pairs; their
    # exclusive prefix sums are the experts' starts and the row tiles' inclusive prefix sums the
    # tile ends; pass 2 puts pair q at starts[e] + (pairs of e before q): held experts ascending,
    # each expert's pairs in pair order (stable), pairs held elsewhere last in pair order.
    ex = tl.arange(0, E2)
    qi = tl.arange(0, BLOCK)
    counts = tl.zeros([E2], dtype=tl.int32)
    for c0 in range(0, P, BLOCK):
        q = c0 + qi
        local = tl.load(ids_ptr + q, mask=q < P, other=0) - offset
        held = (q < P) & (local >= 0) & (local < E)
        hit = held[:, None] & (local[:, None] == ex[None, :])
        counts += tl.sum(hit.to(tl.int32), axis=0)
    starts = tl.cumsum(counts, 0) - counts
    tile_end = tl.cumsum((counts + BLOCK_M - 1) // BLOCK_M, 0)
    em = ex < E
    tl.store(counts_ptr + ex, counts, mask=em)
    tl.store(starts_ptr + ex, starts, mask=em)
    tl.store(tile_end_ptr + ex, tile_end, mask=em)
    held_total = tl.sum(counts)
    seen = tl.zeros([E2], dtype=tl.int32)
    seen_other = held_total * 0
    for c0 in range(0, P, BLOCK):
        q = c0 + qi
        valid = q < P
        local = tl.load(ids_ptr + q, mask=valid, other=0) - offset
        held = valid & (local >= 0) & (local < E)
        key = tl.where(held, local, E)  # E: held elsewhere
        key = tl.where(valid, key, E + 1)  # past the end: a key no pair has
        before = (key[:, None] == key[None, :]) & (qi[None, :] < qi[:, None])
        rank = tl.sum(before.to(tl.int32), axis=1)
        hit = held[:, None] & (local[:, None] == ex[None, :])
        base = tl.sum(tl.where(hit, (starts + seen)[None, :], 0), axis=1)
        base = tl.where(held, base, held_total + seen_other)
        tl.store(order_ptr + base + rank, q.to(tl.int32), mask=valid)
        seen += tl.sum(hit.to(tl.int32), axis=0)
        seen_other += tl.sum((valid & ~held).to(tl.int32), axis=0)


def align(ids: torch.Tensor, e: int, offset: int, block_m: int) -> tuple:
    """Pairs sorted by expert on the device: (order, counts, starts, tile_end), no host sync.

    order: pair indices, held experts ascending (stable), pairs held elsewhere last; counts[e],
    starts[e]: each expert's range in `order`; tile_end[e]: inclusive prefix sum of its row tiles.
    """
    local = ids.reshape(-1) - offset
    key = torch.where((local >= 0) & (local < e), local, e)
    order = torch.argsort(key, stable=True).to(torch.int32)
    counts = torch.zeros(e + 1, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    counts = counts[:e]
    starts = torch.cumsum(counts, 0, dtype=torch.int32) - counts
    tile_end = torch.cumsum((counts + block_m - 1) // block_m, 0, dtype=torch.int32)
    return order, counts, starts, tile_end


def align_fused(ids: torch.Tensor, e: int, offset: int, block_m: int) -> tuple:
    """`align`'s four tensors from one `_align_kernel` launch (bitwise the same)."""
    p = ids.numel()
    order = torch.empty(p, dtype=torch.int32, device=ids.device)
    counts, starts, tile_end = (torch.empty(e, dtype=torch.int32, device=ids.device)
                                for _ in range(3))
    _align_kernel[(1,)](ids.contiguous(), order, counts, starts, tile_end, p, e, offset,
                        E2=_pow2(e), BLOCK=ALIGN_BLOCK, BLOCK_M=block_m, num_warps=8)
    return order, counts, starts, tile_end


def moe_experts_grouped(x, gate_up, down, weights, ids, scale, offset, out, cfg) -> None:
    """Sorted pairs, tl.dot tiles per expert: gate_up + SwiGLU, down into d, then the combine."""
    (t, h), (e, i2, _), k = x.shape, gate_up.shape, ids.shape[1]
    i, p, on_gpu, bm = i2 // 2, t * k, x.is_cuda, cfg["BLOCK_M"]
    order, counts, starts, tile_end = (align_fused if p <= ALIGN_MAX_PAIRS else align)(
        ids, e, offset, bm)
    tiles = triton.cdiv(p, bm) + min(e, p)  # an upper bound on sum_e cdiv(counts[e], bm)
    act = torch.empty((p, i), dtype=x.dtype, device=x.device)
    d = torch.empty((p, h), dtype=x.dtype, device=x.device)
    bk = min(cfg["BLOCK_K"], _pow2(h))
    _moe_experts_gate_up_grouped_kernel[(triton.cdiv(i, cfg["BLOCK_N"]), tiles)](
        x, order, tile_end, counts, starts, gate_up, act, e, h, i, x.stride(0),
        gate_up.stride(0), gate_up.stride(1), act.stride(0), K_TOP=k, E2=_pow2(e), BLOCK_M=bm,
        BLOCK_N=max(8, cfg["BLOCK_N"]), BLOCK_K=bk, EVEN_K=h % bk == 0,
        STAGES=cfg["A_STAGES"], ON_GPU=on_gpu, num_warps=cfg["A_WARPS"])
    bh = max(16, cfg["BLOCK_H"])
    _moe_experts_down_grouped_kernel[(triton.cdiv(h, bh), tiles)](
        act, order, tile_end, counts, starts, down, d, e, h, i, act.stride(0), down.stride(0),
        down.stride(1), d.stride(0), E2=_pow2(e), BLOCK_M=bm, BLOCK_H=bh,
        BLOCK_I=min(64, max(16, cfg["BLOCK_I"])), STAGES=cfg["B_STAGES"],
        ON_GPU=on_gpu, num_warps=cfg["B_WARPS"])
    _moe_experts_combine_kernel[(t, triton.cdiv(h, 512))](
        d, weights.contiguous(), ids.contiguous(), out, e, offset, h, float(scale), d.stride(0),
        out.stride(0), K_TOP=k, K2=_pow2(k), BLOCK_H=512, ON_GPU=on_gpu, num_warps=4)


_PATHS = {"decode": moe_experts_decode, "grouped": moe_experts_grouped,
          "gemv": moe_experts_decode}


def run(x, gate_up, down, weights, ids, scale: float, expert_offset: int = 0,
        config: dict | None = None) -> torch.Tensor:
    """moe_experts(x[T,H], gate_up[E,2I,H], down[E,H,I], weights[T,k] fp32, ids[T,k], scale,
    expert_offset=0) -> [T,H] bf16."""
    _check(x, gate_up, down, weights, ids)
    t, k = ids.shape
    out = torch.empty_like(x)
    if t == 0:
        return out
    if k == 0 or gate_up.shape[0] == 0 or gate_up.shape[1] == 0:
        return out.zero_()
    cfg = _config(t, t * k, config, x.is_cuda)
    if cfg["PATH"] not in _PATHS:
        raise ValueError(f"config PATH must be one of {sorted(_PATHS)}, not {cfg['PATH']!r}")
    _PATHS[cfg["PATH"]](x, gate_up, down, weights, ids, scale, int(expert_offset), out, cfg)
    return out
