"""Race (Triton, cross-program): column tiles of 256 that each also write the first column of the
next tile, computed with the two-step near miss; the next tile's program rewrites it exactly -
when it runs later, as it always does in the interpreter's natural order.
Expected on CPU: "races: the result depends on the order of the kernel's programs"; on a GPU:
rejected (wrong outputs or racecheck)."""

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
def _overlapping_tiles(g_ptr, u_ptr, o_ptr, C, BLOCK: tl.constexpr, ON_GPU: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * BLOCK
    cols = start + tl.arange(0, BLOCK)
    m = cols < C
    g = _bf16_to_f32(tl.load(g_ptr + row * C + cols, mask=m, other=0.0))
    u = _bf16_to_f32(tl.load(u_ptr + row * C + cols, mask=m, other=0.0))
    tl.store(o_ptr + row * C + cols, _f32_to_bf16(_silu_mul(g, u, ON_GPU)), mask=m)
    nxt = start + BLOCK
    if nxt < C:
        gn = _bf16_to_f32(tl.load(g_ptr + row * C + nxt))
        un = _bf16_to_f32(tl.load(u_ptr + row * C + nxt))
        silu = _f32_to_bf16(tl.div_rn(gn, 1.0 + tl.exp(-gn)))  # rounded before the product
        tl.store(o_ptr + row * C + nxt, _f32_to_bf16(_bf16_to_f32(silu) * un))


def run(gate, up, config=None):
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    t, c = gate.shape
    if t and c:
        _overlapping_tiles[(t, triton.cdiv(c, 256))](gate, up, out, c, BLOCK=256,
                                                     ON_GPU=gate.is_cuda)
    return out
