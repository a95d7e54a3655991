"""attn_output_gate: the sigmoid output gate on 2-D tiles of ROWS tokens x BLOCK columns, bitwise.

# {{HEADER}}

Formula (docs/numerics.md "Output gate"), per element of [T, Hq, D] with head j:
    g2  = bf( f32(gate) + f32(bias[j]) )
    s   = bf( 1 / (1 + exp(-f32(g2))) )        torch's sigmoid: IEEE divide, expf
    out = bf( f32(attn) * f32(s) )
Three rounding points, each round-to-nearest-even on the bit pattern (the Triton interpreter's
BF16 cast truncates). The divide is `div_rn` (Triton's `/` is approximate on the GPU) and exp is
libdevice's expf on the GPU; on the CPU exp runs in FP64 and is rounded.
Tiles of several tokens per program: at decode one token row of Hq*D (768 at TP8) is less than
one block, so grouping rows cuts the program count; ROWS and BLOCK are tuned per token bucket.
Layout: heads packed (stride(2) == 1, stride(1) == D), any token stride (gate is a column slice
of the packed qkv+gate GEMM output).
Memory traffic: read 2*T*Hq*D + Hq bf16, write T*Hq*D bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

CONFIG_SPACE = {"ROWS": [1, 2, 4, 8], "BLOCK": [256, 512, 1024, 2048], "num_warps": [2, 4, 8]}
DEFAULT_CONFIG = {"ROWS": 4, "BLOCK": 1024, "num_warps": 4}


# {{common.bf16_to_f32}}: _bf16_to_f32


# {{common.f32_to_bf16}}: _f32_to_bf16


# {{common.exp}}: _exp


@triton.jit
def _gate_tile_kernel(attn_ptr, gate_ptr, bias_ptr, out_ptr, stride_attn, stride_gate,
                      stride_out, T, C, D: tl.constexpr, ROWS: tl.constexpr,
                      BLOCK: tl.constexpr, ON_GPU: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < C
    m = (rows < T)[:, None] & cmask[None, :]
    r, c = rows[:, None], cols[None, :]
    a = _bf16_to_f32(tl.load(attn_ptr + r * stride_attn + c, mask=m, other=0.0))
    g = _bf16_to_f32(tl.load(gate_ptr + r * stride_gate + c, mask=m, other=0.0))
    b = _bf16_to_f32(tl.load(bias_ptr + cols // D, mask=cmask, other=0.0))[None, :]
    g2 = _bf16_to_f32(_f32_to_bf16(g + b))
    s = _bf16_to_f32(_f32_to_bf16(tl.div_rn(1.0, 1.0 + _exp(-g2, ON_GPU))))
    tl.store(out_ptr + r * stride_out + c, _f32_to_bf16(a * s), mask=m)


def _packed(t: torch.Tensor) -> torch.Tensor:
    d = t.shape[2]
    ok = t.stride(2) == 1 and (t.shape[1] == 1 or t.stride(1) == d)
    return t if ok else t.contiguous()


def attn_output_gate_tiles(attn: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor,
                           rows: int, block: int, num_warps: int) -> torch.Tensor:
    """Launch over (token tiles, column blocks of Hq*D) with an explicit config."""
    if attn.dim() != 3 or gate.shape != attn.shape or tuple(bias.shape) != (attn.shape[1],):
        raise ValueError(f"attn_output_gate expects attn[T,Hq,D], gate[T,Hq,D], bias[Hq]; got "
                         f"{tuple(attn.shape)}, {tuple(gate.shape)}, {tuple(bias.shape)}")
    if any(x.dtype != torch.bfloat16 for x in (attn, gate, bias)):
        raise ValueError(f"attn_output_gate expects bf16 inputs; got {attn.dtype}, "
                         f"{gate.dtype}, {bias.dtype}")
    attn, gate, bias = _packed(attn), _packed(gate), bias.contiguous()
    t, hq, d = attn.shape
    out = torch.empty((t, hq, d), dtype=attn.dtype, device=attn.device)
    if out.numel() == 0:
        return out
    c = hq * d
    _gate_tile_kernel[(triton.cdiv(t, rows), triton.cdiv(c, block))](
        attn, gate, bias, out, attn.stride(0), gate.stride(0), out.stride(0), t, c,
        D=d, ROWS=rows, BLOCK=block, ON_GPU=attn.is_cuda, num_warps=num_warps,
    )
    return out


def run(attn: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, config: dict | None = None):
    """attn_output_gate(attn[T,Hq,D], gate[T,Hq,D], bias[Hq]) -> [T,Hq,D], all bf16."""
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    return attn_output_gate_tiles(attn, gate, bias, int(cfg["ROWS"]), int(cfg["BLOCK"]),
                                  int(cfg["num_warps"]))
