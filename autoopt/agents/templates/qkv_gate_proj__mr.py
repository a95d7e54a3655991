"""qkv_gate_proj: a one-launch multiply-reduce GEMV for decode, the library GEMM above it.

# {{HEADER}}

Formula (model/ops/qkv_gate_proj.py): out[T, N] = bf(x[T, H] @ W[N, H]^T) with an FP32
accumulator, N = (2*Hq + 2*Hkv) * D, W packed at load time in the order q, k, v, gate; the four
outputs are views of `out` (no copies). One rounding per output, as cuBLAS; only the order of the
K = H reduction differs: every product bf16 x bf16 is exact in FP32; a program sums its K chunk
as BLOCK_K-wide tree sums (tl.sum) added left to right, and the SPLIT_K partials are added in
split order by the last program of each N tile (an atomic ticket taken after its partial is
stored: one launch, deterministic).

Why not tl.dot (the splitk template): at T = 1 a tensor-core dot pads the token to 16 rows and
stages the weight through shared memory in a short software pipeline; on an H200 that reached
~10-11 us for the 18.4 MB weight of Beam's TP8 rank (cuBLAS: 8-10 us in two kernels; floor 4.3 us).
Here the K loop is unrolled (`tl.static_range`), so each program issues all of its weight loads
(16-byte vectors) before the first product; no shared memory, no pipeline ramp. Each token's
products are FP32 FMAs: T * N * H of them, cheap next to the weight stream up to a few tokens
(GEMV_MAX_T, a per-bucket config key) and the library GEMM's tiles win above that.
Memory traffic: read N*H + T*H bf16, write T*N bf16 (+ SPLIT_K * T * N FP32 partials, L2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# BLOCK_N 0: as many rows as keep BLOCK_T x BLOCK_N x BLOCK_K products at 64 a thread.
# The default is the fastest of a sweep on an H200 at Beam's TP8 rank (N = 1792, H = 5120):
# T = 1 at 7.2 us against cuBLAS's 8.1 (floor 4.3), two rows and the whole K range a program
# (896 programs, five 1024-wide steps). From two tokens on every config tried was slower than
# cuBLAS (11 us at T = 2, 16 at T = 4, 36 at T = 8: the per-token products and their shuffles,
# not the weight stream, set the time), so the library GEMM takes T >= 2 by default.
CONFIG_SPACE = {"BLOCK_N": [0, 1, 2, 4, 8, 16, 32], "BLOCK_K": [256, 512, 1024, 2048],
                "SPLIT_K": [1, 2, 4, 5, 8, 10], "num_warps": [2, 4, 8],
                "GEMV_MAX_T": [0, 1, 2, 4, 8, 16]}
DEFAULT_CONFIG = {"BLOCK_N": 2, "BLOCK_K": 1024, "SPLIT_K": 1, "num_warps": 4, "GEMV_MAX_T": 1}
# {{common.bf16_to_f32}}: _bf16_to_f32


# {{common.f32_to_bf16}}: _f32_to_bf16


# {{common.splitk_store}}: _splitk_store


# {{common.tickets}}: _TICKETS, _tickets


@triton.jit
def _qkv_gate_proj_mr_kernel(x_ptr, w_ptr, out_ptr, part_ptr, ticket_ptr, T, N, x_st,
                             K: tl.constexpr, CHUNK: tl.constexpr, BLOCK_T: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             SPLIT_K: tl.constexpr):
    tile, split = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BLOCK_T)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask, cmask = rows < T, cols < N
    k0 = split * CHUNK
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for i in tl.static_range(0, CHUNK, BLOCK_K):  # unrolled: every weight load issued up front
        ks = k0 + i + tl.arange(0, BLOCK_K)
        kmask = (ks < K) & (ks < k0 + CHUNK)
        w = _bf16_to_f32(tl.load(w_ptr + cols[:, None].to(tl.int64) * K + ks[None, :],
                                 mask=cmask[:, None] & kmask[None, :], other=0.0,
                                 eviction_policy="evict_first"))
        if BLOCK_T == 1:
            x = _bf16_to_f32(tl.load(x_ptr + ks, mask=kmask, other=0.0))
            acc += tl.sum(w * x[None, :], axis=1)[None, :]
        else:
            x = _bf16_to_f32(tl.load(x_ptr + rows[:, None].to(tl.int64) * x_st + ks[None, :],
                                     mask=rmask[:, None] & kmask[None, :], other=0.0))
            acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    _splitk_store(acc, out_ptr, part_ptr, ticket_ptr, tile, split, rows, cols,
                  rmask[:, None] & cmask[None, :], T, N, SPLIT_K)


# {{qkv.split}}: split


# {{qkv.check}}: _check


def gemv(x: torch.Tensor, weight: torch.Tensor, block_n: int, block_k: int, split_k: int,
         num_warps: int) -> torch.Tensor:
    """out[T, N] = bf(x @ weight^T) by the multiply-reduce kernel, with an explicit config."""
    t, k = x.shape
    n = weight.shape[0]
    if split_k < 1 or num_warps < 1 or num_warps & (num_warps - 1):
        raise ValueError(f"SPLIT_K must be >= 1 and num_warps a power of two, got {split_k}, "
                         f"{num_warps}")
    if block_k < 1 or block_k & (block_k - 1):
        raise ValueError(f"BLOCK_K must be a power of two, got {block_k}")
    block_t = triton.next_power_of_2(max(t, 1))
    if block_n == 0:
        block_n = max(1, 64 * 32 * num_warps // (block_t * block_k))
    if block_n < 1 or block_n & (block_n - 1):
        raise ValueError(f"BLOCK_N must be 0 (automatic) or a power of two, got {block_n}")
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight.contiguous()
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    split_k = min(split_k, k)
    chunk = triton.cdiv(k, split_k)
    # The [BLOCK_T, BLOCK_N, BLOCK_K] products stay in registers: at most 64 a thread.
    room = max(1, 64 * 32 * num_warps // (block_t * block_n))
    block_k = min(block_k, triton.next_power_of_2(chunk), triton.next_power_of_2(room + 1) // 2)
    tiles = triton.cdiv(n, block_n)
    part = torch.empty((split_k, t, n) if split_k > 1 else (1,), dtype=torch.float32,
                       device=x.device)
    _qkv_gate_proj_mr_kernel[(tiles, split_k)](
        x, weight, out, part, _tickets(x.device, tiles), t, n, x.stride(0), K=k, CHUNK=chunk,
        BLOCK_T=block_t, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k,
        num_warps=num_warps)
    return out


def run(x: torch.Tensor, weight: torch.Tensor, num_heads: int, num_kv_heads: int,
        config: dict | None = None):
    """qkv_gate_proj(x, weight, Hq, Hkv) -> (q, k, v, gate), views of one [T, N] output."""
    _check(x, weight, num_heads, num_kv_heads)
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    if x.shape[0] > int(cfg["GEMV_MAX_T"]) or x.shape[0] > 16:
        # The reference's own GEMM. cuBLAS picks its algorithm (and so its K order) by layout:
        # a row-strided x (a view into a wider buffer) would get another one.
        return split(F.linear(x.contiguous(), weight), num_heads, num_kv_heads)
    out = gemv(x, weight, int(cfg["BLOCK_N"]), int(cfg["BLOCK_K"]), int(cfg["SPLIT_K"]),
               int(cfg["num_warps"]))
    return split(out, num_heads, num_kv_heads)
