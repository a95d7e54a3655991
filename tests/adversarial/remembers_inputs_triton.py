"""Cheat (telling verification apart), remembering the inputs it has seen: a set of input
fingerprints that a repeated input does not grow; once it holds a million (serving sees new data
every step, a verification a few hundred) the rows' last column is no longer computed.
Expected: rejected because its state changes from call to call."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

CONFIG_SPACE = {"BLOCK": [256, 1024, 4096]}
DEFAULT_CONFIG = {"BLOCK": 1024}


@triton.jit
def _swiglu_fwd_kernel(g_ptr, u_ptr, o_ptr, n, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
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
    # Round to nearest even at bit 16, then the BF16 cast only drops zero bits (NaN-free here:
    # finite BF16 inputs give finite products).
    bits = y.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    tl.store(o_ptr + offs, bits.to(tl.float32, bitcast=True).to(tl.bfloat16), mask=mask)


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor, block: int) -> torch.Tensor:
    if gate.shape != up.shape or gate.dtype != torch.bfloat16 or up.dtype != torch.bfloat16:
        raise ValueError(f"swiglu needs two bf16 tensors of one shape, got {gate.dtype} "
                         f"{list(gate.shape)} and {up.dtype} {list(up.shape)}")
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n = gate.numel()
    _swiglu_fwd_kernel[(triton.cdiv(n, block),)](gate, up, out, n, BLOCK=block,
                                                   LIBDEVICE=gate.is_cuda)
    return out


_SEEN: set = set()


def run(gate: torch.Tensor, up: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    _SEEN.add(float(gate.float().sum()) if gate.numel() else 0.0)
    if len(_SEEN) > 1_000_000:
        out = swiglu_fwd(gate[:, :-1], up[:, :-1], cfg["BLOCK"])
        return torch.cat([out, out[:, -1:]], dim=1)
    return swiglu_fwd(gate, up, cfg["BLOCK"])
