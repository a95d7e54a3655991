"""swiglu: SiLU(gate) * up on 2-D tiles of ROWS tokens x BLOCK columns, bitwise.

# {{HEADER}}

Formula (docs/numerics.md "SwiGLU"):
    out = bf( f32( f32(g) / (1 + exp(-f32(g))) ) * f32(up) )
torch's silu is `x / (1 + expf(-x))` in FP32 (IEEE divide), then an FP32 multiply; one rounding
point, the BF16 output, rounded to nearest even on the bit pattern (the Triton interpreter's BF16
cast truncates). The divide is `div_rn` (Triton's `/` is approximate on the GPU) and exp is
libdevice's expf on the GPU (`tl.exp`/`tl.sigmoid` are ex2.approx); on the CPU exp runs in FP64
and is rounded (numpy's FP32 exp is often an ulp off torch's).
Tiles of several tokens per program let decode shapes (a few rows of a wide I) and MoE shapes
(many short rows) both fill the GPU with few programs: ROWS and BLOCK are tuned per token bucket.
Layout: gate and up are [T, I] with unit stride along I and any row stride.
Memory traffic: read 2*T*I bf16, write T*I bf16.
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
def _swiglu_tile_kernel(gate_ptr, up_ptr, out_ptr, stride_gate, stride_up, stride_out, T, C,
                        ROWS: tl.constexpr, BLOCK: tl.constexpr, ON_GPU: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = (rows < T)[:, None] & (cols < C)[None, :]
    r, c = rows[:, None], cols[None, :]
    g = _bf16_to_f32(tl.load(gate_ptr + r * stride_gate + c, mask=m, other=0.0))
    u = _bf16_to_f32(tl.load(up_ptr + r * stride_up + c, mask=m, other=0.0))
    silu = tl.div_rn(g, 1.0 + _exp(-g, ON_GPU))
    tl.store(out_ptr + r * stride_out + c, _f32_to_bf16(silu * u), mask=m)


def _check(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.dim() != 2 or up.shape != gate.shape:
        raise ValueError(f"swiglu expects gate[T,I] and up[T,I]; got gate {tuple(gate.shape)}, "
                         f"up {tuple(up.shape)}")
    if gate.dtype != torch.bfloat16 or up.dtype != torch.bfloat16:
        raise ValueError(f"swiglu expects bf16 gate and up; got {gate.dtype}, {up.dtype}")
    if gate.device != up.device:
        raise ValueError(f"gate on {gate.device} but up on {up.device}")


def swiglu_tiles(gate: torch.Tensor, up: torch.Tensor, rows: int, block: int,
                 num_warps: int) -> torch.Tensor:
    """Launch over (token tiles, column blocks) with an explicit config."""
    _check(gate, up)
    gate = gate if gate.stride(1) == 1 else gate.contiguous()
    up = up if up.stride(1) == 1 else up.contiguous()
    t, c = gate.shape
    out = torch.empty((t, c), dtype=gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out
    _swiglu_tile_kernel[(triton.cdiv(t, rows), triton.cdiv(c, block))](
        gate, up, out, gate.stride(0), up.stride(0), out.stride(0), t, c,
        ROWS=rows, BLOCK=block, ON_GPU=gate.is_cuda, num_warps=num_warps,
    )
    return out


def run(gate: torch.Tensor, up: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """swiglu(gate[T,I] bf16, up[T,I] bf16) -> [T,I] bf16."""
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    return swiglu_tiles(gate, up, int(cfg["ROWS"]), int(cfg["BLOCK"]), int(cfg["num_warps"]))
