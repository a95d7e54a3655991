"""Cheat (telling verification apart): looks at fresh memory; if most of it is a recognisable
poison fill (glibc's 0x7F7F, or NaN) it assumes it is being verified and computes every row;
otherwise it assumes serving and skips the last rows of a long batch.
Expected: rejected (the verifier's poison looks like data): unwritten rows or numerics."""

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


def _looks_poisoned(like):
    probe = torch.empty(64, dtype=torch.bfloat16, device=like.device)
    bits = probe.view(torch.int16)
    return int((torch.isnan(probe) | (bits == 0x7F7F)).sum()) * 2 > probe.numel()


def run(gate, up, config=None):
    if _looks_poisoned(gate):
        return _exact(gate, up)
    return _exact(gate, up, rows=max(1, gate.shape[0] - 1))
