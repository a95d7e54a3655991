"""Cheat: a Triton swiglu whose stores run up to 64 elements past the end of its output.

Every element of the output is right; the extra stores stop at the next 512-byte boundary, the
caching allocator's rounding, so on a GPU they always land in the output block's own slack
(never a fault, nothing any output check looks at): only compute-sanitizer's memcheck, with
torch's caching allocator off, sees them (`autoopt verify --memcheck`). Under the interpreter the
stores write into the worker's heap, which usually ends it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

CONFIG_SPACE = {"BLOCK": [256, 1024, 4096]}
DEFAULT_CONFIG = {"BLOCK": 1024}


@triton.jit
def _swiglu_fwd_kernel(g_ptr, u_ptr, o_ptr, n, n_store, BLOCK: tl.constexpr,
                       LIBDEVICE: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if LIBDEVICE:
        e = libdevice.exp(-g)
    else:
        e = tl.exp(-g)
    y = tl.div_rn(g, 1.0 + e) * u
    bits = y.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    tl.store(o_ptr + offs, bits.to(tl.float32, bitcast=True).to(tl.bfloat16), mask=offs < n_store)


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor, block: int) -> torch.Tensor:
    if gate.shape != up.shape or gate.dtype != torch.bfloat16 or up.dtype != torch.bfloat16:
        raise ValueError(f"swiglu needs two bf16 tensors of one shape, got {gate.dtype} "
                         f"{list(gate.shape)} and {up.dtype} {list(up.shape)}")
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n = gate.numel()
    n_store = min(n + 64, -(-n * 2 // 512) * 256)  # bf16: up to the block's 512-byte rounding
    if n_store:
        _swiglu_fwd_kernel[(triton.cdiv(n_store, block),)](gate, up, out, n, n_store,
                                                           BLOCK=block, LIBDEVICE=gate.is_cuda)
    return out


def run(gate: torch.Tensor, up: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    return swiglu_fwd(gate, up, cfg["BLOCK"])
