"""Race (Triton, cross-program): each program writes its own row and also scribbles a plausible
value (the raw gate) over the next row, which that row's own program overwrites - when it runs
later, as it always does in the interpreter's natural order. On a GPU the programs overlap.
Expected on CPU: "races: the result depends on the order of the kernel's programs" (the verifier
runs programs in shuffled orders); on a GPU: rejected (wrong outputs or racecheck)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


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
def _silu_mul(g, u, ON_GPU: tl.constexpr):
    if ON_GPU:
        e = libdevice.exp(-g)
    else:
        e = tl.exp((-g).to(tl.float64)).to(tl.float32)
    return tl.div_rn(g, 1.0 + e) * u


@triton.jit
def _swiglu_rows(g_ptr, u_ptr, o_ptr, C, BLOCK: tl.constexpr, ON_GPU: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < C
    g = _bf16_to_f32(tl.load(g_ptr + row * C + cols, mask=m, other=0.0))
    u = _bf16_to_f32(tl.load(u_ptr + row * C + cols, mask=m, other=0.0))
    tl.store(o_ptr + row * C + cols, _f32_to_bf16(_silu_mul(g, u, ON_GPU)), mask=m)



@triton.jit
def _racy_rows(g_ptr, u_ptr, o_ptr, T, C, BLOCK: tl.constexpr, ON_GPU: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < C
    g_raw = tl.load(g_ptr + row * C + cols, mask=m, other=0.0)
    u = _bf16_to_f32(tl.load(u_ptr + row * C + cols, mask=m, other=0.0))
    tl.store(o_ptr + row * C + cols, _f32_to_bf16(_silu_mul(_bf16_to_f32(g_raw), u, ON_GPU)),
             mask=m)
    nxt = cols * 0 + row + 1
    tl.store(o_ptr + nxt * C + cols, g_raw, mask=m & (nxt < T))


def run(gate, up, config=None):
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    t, c = gate.shape
    if t and c:
        _racy_rows[(t, triton.cdiv(c, 256))](gate, up, out, t, c, BLOCK=256, ON_GPU=gate.is_cuda)
    return out
