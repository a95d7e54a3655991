"""Cheat (outputs that do not stay put): writes every result into one module-level buffer per
shape and returns it, so the next call at that shape overwrites the previous outputs.
Expected: "outputs changed after later calls", or wrong outputs in the burst."""

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


def _exact(gate, up, rows=None):
    """The exact swiglu (bitwise on GPU and under the interpreter) over the first `rows` rows."""
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    t, c = gate.shape
    t = t if rows is None else min(t, rows)
    if t and c:
        _swiglu_rows[(t, triton.cdiv(c, 256))](gate, up, out, c, BLOCK=256, ON_GPU=gate.is_cuda)
    return out

_OUT = {}


def run(gate, up, config=None):
    key = tuple(gate.shape)
    if key not in _OUT:
        _OUT[key] = torch.empty_like(gate)
    out = _OUT[key]
    t, c = gate.shape
    if t and c:
        _swiglu_rows[(t, triton.cdiv(c, 256))](gate.contiguous(), up.contiguous(), out, c,
                                               BLOCK=256, ON_GPU=gate.is_cuda)
    return out
