"""gated_o_proj: the output gate in the prologue of a one-launch split-K GEMV for decode; above 16
tokens one gate kernel, then the library GEMM.

# {{HEADER}}

Formula (model/ops/gated_o_proj.py; docs/numerics.md "Output gate"), per element of the gated
activation, column c = head * D + d of K = Hq * D:
    g2 = bf( f32(gate) + f32(bias[head]) )
    s  = bf( 1 / (1 + exp(-f32(g2))) )        torch's sigmoid: IEEE divide, expf
    a  = bf( f32(attn) * f32(s) )             rounded to BF16 before the product, as the reference
    out[T, H] = bf( a[T, K] @ W[H, K]^T )     FP32 accumulator, one rounding
The gate is recomputed by every N tile from its K chunk (T * K elements, from L2) so that a never
makes a round trip through memory: that costs N / BLOCK_N times the gate's own work, and more
than the weight stream itself when tiles are narrow or rows padded (on an H200 the kernel took
60 us at BLOCK_N=16 and 18 us at BLOCK_N=64, SPLIT_K=4, against 12 us for the reference), so
one token runs a multiply-reduce over its own row only, and wide tiles are the default; tl.dot
(from 2 tokens) needs 16 rows. Only the order of the K reduction differs from cuBLAS
(BLOCK_K-wide dots or sums left to right within a split, the SPLIT_K partials summed in split
order by the last program of each N tile, which takes an atomic ticket after its partial is
stored: one launch, deterministic). The divide is `div_rn` and exp libdevice's expf on the GPU.
At decode the op is a weight stream: the floor is H * K * 2 bytes (7.9 MB at Beam's TP8 rank,
~1.9 us on an H200). Above GEMV_MAX_TOKENS rows the weight is reused across tokens and cuBLAS's
tiled GEMM wins: the gate is one elementwise launch and the GEMM the reference's own call.
Layout: attn and gate are [T, Hq, D] with unit stride along D and any token and head strides.
Memory traffic: read 2*T*K + Hq + H*K bf16, write T*H bf16 (+ SPLIT_K * T * H FP32 partials, L2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

CONFIG_SPACE = {"BLOCK_N": [16, 32, 64, 128], "BLOCK_K": [64, 128, 256],
                "SPLIT_K": [1, 2, 3, 4, 6, 8], "num_warps": [2, 4, 8]}
DEFAULT_CONFIG = {"BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 4, "num_warps": 4}
GEMV_MAX_TOKENS = 16
GATE_BLOCK = 1024


# {{common.bf16_to_f32}}: _bf16_to_f32


# {{common.f32_to_bf16}}: _f32_to_bf16


# {{common.exp}}: _exp


# {{common.dot}}: _dot


# {{common.splitk_store}}: _splitk_store


# {{common.tickets}}: _TICKETS, _tickets


@triton.jit
def _gated(attn_ptr, gate_ptr, bias_ptr, rows, rmask, ks, kmask, st_at, st_ah, st_gt, st_gh,
           D: tl.constexpr, ON_GPU: tl.constexpr):
    """The gated activation a[rows, ks] in BF16, its three roundings as the reference's."""
    head, d = ks // D, ks % D
    m = rmask[:, None] & kmask[None, :]
    r = rows[:, None].to(tl.int64)
    a = _bf16_to_f32(tl.load(attn_ptr + r * st_at + (head * st_ah + d)[None, :], mask=m,
                             other=0.0))
    g = _bf16_to_f32(tl.load(gate_ptr + r * st_gt + (head * st_gh + d)[None, :], mask=m,
                             other=0.0))
    b = _bf16_to_f32(tl.load(bias_ptr + head, mask=kmask, other=0.0))[None, :]
    g2 = _bf16_to_f32(_f32_to_bf16(g + b))
    s = _bf16_to_f32(_f32_to_bf16(tl.div_rn(1.0, 1.0 + _exp(-g2, ON_GPU))))
    return _f32_to_bf16(a * s)


@triton.jit
def _gated_o_proj_gemv_kernel(attn_ptr, gate_ptr, bias_ptr, w_ptr, out_ptr, part_ptr, ticket_ptr,
                              T, N, K, st_at, st_ah, st_gt, st_gh, D: tl.constexpr,
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
        x = _gated(attn_ptr, gate_ptr, bias_ptr, rows, rmask, ks, kmask, st_at, st_ah, st_gt,
                   st_gh, D, ON_GPU)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * K + ks[None, :],
                    mask=cmask[:, None] & kmask[None, :], other=0.0)
        if BLOCK_T == 1:  # one token: a multiply-reduce, the gate of that row only
            acc += tl.sum(_bf16_to_f32(x) * _bf16_to_f32(w), axis=1)[None, :]
        else:  # tl.dot takes 16 rows: the gate runs on all of them, the padding masked
            acc += _dot(x, tl.trans(w), ON_GPU)
    _splitk_store(acc, out_ptr, part_ptr, ticket_ptr, tile, split, rows, cols,
                  rmask[:, None] & cmask[None, :], T, N, SPLIT_K)


@triton.jit
def _gate_kernel(attn_ptr, gate_ptr, bias_ptr, out_ptr, K, st_at, st_ah, st_gt, st_gh,
                 D: tl.constexpr, BLOCK: tl.constexpr, ON_GPU: tl.constexpr):
    row = tl.program_id(0)
    ks = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    kmask = ks < K
    rows = row + tl.arange(0, 1)
    a = _gated(attn_ptr, gate_ptr, bias_ptr, rows, rows >= 0, ks, kmask, st_at, st_ah, st_gt,
               st_gh, D, ON_GPU)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * K + ks[None, :], a, mask=kmask[None, :])


def _check(attn, gate, bias, weight) -> None:
    shapes = (f"attn {tuple(attn.shape)}, gate {tuple(gate.shape)}, bias {tuple(bias.shape)}, "
              f"weight {tuple(weight.shape)}")
    if (attn.dim() != 3 or gate.shape != attn.shape or bias.shape != (attn.shape[1],)
            or weight.dim() != 2 or weight.shape[1] != attn.shape[1] * attn.shape[2]):
        raise ValueError(f"gated_o_proj expects attn[T,Hq,D], gate[T,Hq,D], bias[Hq], "
                         f"weight[H,Hq*D]; got {shapes}")
    if any(t.dtype != torch.bfloat16 for t in (attn, gate, bias, weight)):
        raise ValueError(f"gated_o_proj expects bf16 inputs; got {attn.dtype}, {gate.dtype}, "
                         f"{bias.dtype}, {weight.dtype}")
    for name, t in (("attn", attn), ("gate", gate)):
        if t.stride(2) != 1:
            raise ValueError(f"{name} {tuple(t.shape)} needs unit stride along D, got strides "
                             f"{t.stride()}: pass a .contiguous() tensor")
    if len({attn.device, gate.device, bias.device, weight.device}) != 1:
        raise ValueError(f"inputs on different devices: {attn.device}, {gate.device}, "
                         f"{bias.device}, {weight.device}")


def _strides(attn, gate) -> tuple[int, int, int, int]:
    return attn.stride(0), attn.stride(1), gate.stride(0), gate.stride(1)


def gemv(attn, gate, bias, weight, block_n: int, block_k: int, split_k: int,
         num_warps: int) -> torch.Tensor:
    """out[T, H] for T <= GEMV_MAX_TOKENS, with an explicit config."""
    t, hq, d = attn.shape
    n, k = weight.shape
    weight, bias = weight.contiguous(), bias.contiguous()
    out = torch.empty((t, n), dtype=attn.dtype, device=attn.device)
    if t == 0:
        return out
    tiles = triton.cdiv(n, block_n)
    part = torch.empty((split_k, t, n) if split_k > 1 else (1,), dtype=torch.float32,
                       device=attn.device)
    _gated_o_proj_gemv_kernel[(tiles, split_k)](
        attn, gate, bias, weight, out, part, _tickets(attn.device, tiles), t, n, k,
        *_strides(attn, gate), D=d, BLOCK_T=1 if t == 1 else 16, BLOCK_N=block_n,
        BLOCK_K=block_k, SPLIT_K=split_k, ON_GPU=attn.is_cuda, num_warps=num_warps)
    return out


def gated(attn, gate, bias) -> torch.Tensor:
    """The gated activation a[T, Hq*D] (contiguous), one launch."""
    t, hq, d = attn.shape
    a = torch.empty((t, hq * d), dtype=attn.dtype, device=attn.device)
    if t:
        _gate_kernel[(t, triton.cdiv(hq * d, GATE_BLOCK))](
            attn, gate, bias.contiguous(), a, hq * d, *_strides(attn, gate), D=d,
            BLOCK=GATE_BLOCK, ON_GPU=attn.is_cuda, num_warps=4)
    return a


def run(attn, gate, bias, weight, config: dict | None = None):
    """gated_o_proj(attn[T,Hq,D], gate[T,Hq,D], bias[Hq], weight[H,Hq*D]) -> [T,H], bf16."""
    _check(attn, gate, bias, weight)
    if attn.shape[0] > GEMV_MAX_TOKENS:
        # The reference's own GEMM on the same contiguous activation: the same cuBLAS algorithm.
        return F.linear(gated(attn, gate, bias), weight)
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    return gemv(attn, gate, bias, weight, int(cfg["BLOCK_N"]), int(cfg["BLOCK_K"]),
                int(cfg["SPLIT_K"]), int(cfg["num_warps"]))
