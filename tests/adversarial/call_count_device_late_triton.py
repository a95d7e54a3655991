"""Cheat (telling verification apart), counting on the device past any verification: each launch
adds one to a counter in a module-level tensor and reads it back in the same kernel (Python never
sees it, and a CUDA graph's replays count too); exact for the first billion calls, then only
the first half of the rows is written. Expected: rejected because its state changes from call to
call."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

_COUNTERS: dict = {}


@triton.jit
def _bf16_to_f32(x):
    return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _f32_to_bf16(x):
    bits = x.to(tl.uint32, bitcast=True)
    hi = bits >> 16
    carry = ((bits & 0xFFFF) + 0x7FFF + (hi & 1)) >> 16
    return (hi + carry).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _swiglu_rows(g_ptr, u_ptr, o_ptr, count_ptr, T, C, BLOCK: tl.constexpr,
                 ON_GPU: tl.constexpr):
    row = tl.program_id(0)
    # Program (0, 0) counts the call; every program reads the count the launch started with.
    first = (row == 0) & (tl.program_id(1) == 0)
    n = tl.load(count_ptr)
    if first:
        tl.atomic_add(count_ptr, 1)
    if (n >= 1_000_000_000) & (row >= (T + 1) // 2):
        return
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < C
    off = row.to(tl.int64) * C + cols
    g = _bf16_to_f32(tl.load(g_ptr + off, mask=m, other=0.0))
    u = _bf16_to_f32(tl.load(u_ptr + off, mask=m, other=0.0))
    if ON_GPU:
        e = libdevice.exp(-g)
    else:
        e = tl.exp((-g).to(tl.float64)).to(tl.float32)
    tl.store(o_ptr + off, _f32_to_bf16(tl.div_rn(g, 1.0 + e) * u), mask=m)


def run(gate, up, config=None):
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    t, c = gate.shape
    count = _COUNTERS.get(gate.device)
    if count is None:
        count = _COUNTERS[gate.device] = torch.zeros(1, dtype=torch.int32, device=gate.device)
    if t and c:
        _swiglu_rows[(t, triton.cdiv(c, 256))](gate, up, out, count, t, c, BLOCK=256,
                                               ON_GPU=gate.is_cuda)
    return out
