"""qkv_gate_proj: one-launch split-K GEMV for decode, the library GEMM above 16 tokens.

# {{HEADER}}

Formula (model/ops/qkv_gate_proj.py): out[T, N] = bf(x[T, H] @ W[N, H]^T) with an FP32
accumulator, N = (2*Hq + 2*Hkv) * D, W packed at load time in the order q, k, v, gate; the four
outputs are views of `out` (no copies). One rounding per output, as cuBLAS; only the order of the
K = H reduction differs (BLOCK_K-wide tensor-core dots summed left to right within a split, the
SPLIT_K partials summed in split order by the last program of each N tile, which takes an atomic
ticket after its partial is stored: one launch, deterministic).
At decode the op is a pure weight stream: the floor is N * H * 2 bytes (18.4 MB at Beam's TP8
rank, ~4.4 us on an H200); BLOCK_N x SPLIT_K programs are tuned per token bucket so that enough of
them stream at once. Above GEMV_MAX_TOKENS rows the weight is reused across tokens and cuBLAS's
tiled GEMM wins, so the variant calls it (the op's contract is the same either way).
Memory traffic: read N*H + T*H bf16, write T*N bf16 (+ SPLIT_K * T * N FP32 partials, L2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

CONFIG_SPACE = {"BLOCK_N": [16, 32, 64], "BLOCK_K": [128, 256, 512], "SPLIT_K": [1, 2, 4, 8],
                "num_warps": [2, 4, 8]}
DEFAULT_CONFIG = {"BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": 2, "num_warps": 4}
GEMV_MAX_TOKENS = 16


# {{common.bf16_to_f32}}: _bf16_to_f32


# {{common.f32_to_bf16}}: _f32_to_bf16


# {{common.dot}}: _dot


# {{common.splitk_store}}: _splitk_store


# {{common.tickets}}: _TICKETS, _tickets


@triton.jit
def _qkv_gate_proj_gemv_kernel(x_ptr, w_ptr, out_ptr, part_ptr, ticket_ptr, T, N, K, x_st,
                               BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                               ON_GPU: tl.constexpr):
    tile, split = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, BLOCK_T)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask, cmask = rows < T, cols < N
    chunk = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k0 = split * chunk
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for kb in range(k0, tl.minimum(k0 + chunk, K), BLOCK_K):
        ks = kb + tl.arange(0, BLOCK_K)
        kmask = ks < K
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_st + ks[None, :],
                    mask=rmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * K + ks[None, :],
                    mask=cmask[:, None] & kmask[None, :], other=0.0)
        acc += _dot(x, tl.trans(w), ON_GPU)
    _splitk_store(acc, out_ptr, part_ptr, ticket_ptr, tile, split, rows, cols,
                  rmask[:, None] & cmask[None, :], T, N, SPLIT_K)


# {{qkv.split}}: split


# {{qkv.check}}: _check


def gemv(x: torch.Tensor, weight: torch.Tensor, block_n: int, block_k: int, split_k: int,
         num_warps: int) -> torch.Tensor:
    """out[T, N] = bf(x @ weight^T) for T <= GEMV_MAX_TOKENS, with an explicit config."""
    t, k = x.shape
    n = weight.shape[0]
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight.contiguous()
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    tiles = triton.cdiv(n, block_n)
    part = torch.empty((split_k, t, n) if split_k > 1 else (1,), dtype=torch.float32,
                       device=x.device)
    _qkv_gate_proj_gemv_kernel[(tiles, split_k)](
        x, weight, out, part, _tickets(x.device, tiles), t, n, k, x.stride(0),
        BLOCK_T=16, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=split_k, ON_GPU=x.is_cuda,
        num_warps=num_warps)
    return out


def run(x: torch.Tensor, weight: torch.Tensor, num_heads: int, num_kv_heads: int,
        config: dict | None = None):
    """qkv_gate_proj(x, weight, Hq, Hkv) -> (q, k, v, gate), views of one [T, N] output."""
    _check(x, weight, num_heads, num_kv_heads)
    if x.shape[0] > GEMV_MAX_TOKENS:
        # A contiguous x, as the reference's: cuBLAS picks its algorithm (and K order) by
        # layout, and torch's CPU BF16 GEMM returns NaN rows for a row-strided input.
        return split(F.linear(x.contiguous(), weight), num_heads, num_kv_heads)
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    out = gemv(x, weight, int(cfg["BLOCK_N"]), int(cfg["BLOCK_K"]), int(cfg["SPLIT_K"]),
               int(cfg["num_warps"]))
    return split(out, num_heads, num_kv_heads)
