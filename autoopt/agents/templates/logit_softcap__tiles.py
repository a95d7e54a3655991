"""logit_softcap: FP32 logits = tanh(z / cap) * cap on 2-D tiles of ROWS tokens x BLOCK columns.

# {{HEADER}}

Formula (docs/numerics.md "Final norm, lm_head, softcap"): out = f32( tanh(f32(z) / cap) ) * cap,
no BF16 rounding (the output is FP32), bitwise. The division is what torch does for a tensor
divided by a Python float on this device: on CUDA a multiply by the FP32 reciprocal
(ATen div_true_kernel_cuda), on the CPU a true divide. On the GPU tanh is libdevice's tanhf (what
torch calls) and the products are `mul_rn` (no FMA contraction). On the CPU (interpreter, no
libdevice) tanh is evaluated in FP64 and rounded, within the CPU policy of the verifier.
Tiles of several tokens per program: decode has a few rows of a wide vocabulary shard.
Memory traffic: read T*V bf16, write T*V fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

CONFIG_SPACE = {"ROWS": [1, 2, 4, 8], "BLOCK": [512, 1024, 2048, 4096], "num_warps": [2, 4, 8]}
DEFAULT_CONFIG = {"ROWS": 4, "BLOCK": 1024, "num_warps": 4}


# {{common.bf16_to_f32}}: _bf16_to_f32


@triton.jit
def _tanh(y, ON_GPU: tl.constexpr):
    if ON_GPU:
        return libdevice.tanh(y)
    else:
        d = y.to(tl.float64)
        ad = tl.abs(d)
        e = tl.exp(-2.0 * ad)
        big = (1.0 - e) / (1.0 + e)
        small = ad - ad * ad * ad / 3.0  # near 0, 1 - e cancels; the series is exact there
        th = tl.where(ad < 1e-4, small, big)
        th = tl.where(d < 0, -th, th)
        th = tl.where(ad == 0, d, th)  # keeps the sign of zero
        return th.to(tl.float32)


@triton.jit
def _softcap_tile_kernel(z_ptr, out_ptr, stride_z, stride_out, T, C, cap, inv_cap,
                         ROWS: tl.constexpr, BLOCK: tl.constexpr, ON_GPU: tl.constexpr):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = (rows < T)[:, None] & (cols < C)[None, :]
    r, c = rows[:, None], cols[None, :]
    z = _bf16_to_f32(tl.load(z_ptr + r * stride_z + c, mask=m, other=0.0))
    if ON_GPU:
        out = libdevice.mul_rn(_tanh(libdevice.mul_rn(z, inv_cap), ON_GPU), cap)
    else:
        out = _tanh(tl.div_rn(z, cap), ON_GPU) * cap
    tl.store(out_ptr + r * stride_out + c, out, mask=m)


def logit_softcap_tiles(logits: torch.Tensor, cap: float, rows: int, block: int,
                        num_warps: int) -> torch.Tensor:
    """Launch over (token tiles, column blocks of V) with an explicit config."""
    if logits.dim() != 2 or logits.dtype != torch.bfloat16:
        raise ValueError(f"logit_softcap expects bf16 logits[T,V]; got {tuple(logits.shape)} "
                         f"{logits.dtype}")
    if not cap > 0:
        raise ValueError(f"cap must be a positive float, got {cap}")
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    t, c = logits.shape
    out = torch.empty((t, c), dtype=torch.float32, device=logits.device)
    if out.numel() == 0:
        return out
    _softcap_tile_kernel[(triton.cdiv(t, rows), triton.cdiv(c, block))](
        logits, out, logits.stride(0), out.stride(0), t, c, cap, 1.0 / cap,
        ROWS=rows, BLOCK=block, ON_GPU=logits.is_cuda, num_warps=num_warps,
    )
    return out


def run(logits: torch.Tensor, cap: float, config: dict | None = None) -> torch.Tensor:
    """logit_softcap(logits[T,V] bf16, cap) -> [T,V] fp32."""
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    return logit_softcap_tiles(logits, cap, int(cfg["ROWS"]), int(cfg["BLOCK"]),
                               int(cfg["num_warps"]))
