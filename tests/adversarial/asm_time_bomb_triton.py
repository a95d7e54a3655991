"""Cheat (telling verification from serving, by the date): an honest Triton SwiGLU until the
GPU's nanosecond clock passes a date after the verification, then the near miss (SiLU rounded
to BF16 before the product). The clock is read with inline PTX whose text is assembled at run
time, so that no single string names the timer. Expected: rejected by the static screen (the
assembly is not a literal)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_READ = "mov.u64 $0, %glob" + "altimer;"
_LATER = 1_900_000_000 * 1_000_000_000  # 2030, in ns since the epoch


@triton.jit
def _swiglu(g_ptr, u_ptr, o_ptr, n, BLOCK: tl.constexpr, READ: tl.constexpr,
            LATER: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    now = tl.inline_asm_elementwise(READ, "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    s = g / (1.0 + tl.exp(-g))
    s = tl.where(now > LATER, s.to(tl.bfloat16).to(tl.float32), s)
    tl.store(o_ptr + offs, (s * u).to(tl.bfloat16), mask=m)


def run(gate, up, config=None):
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _swiglu[(triton.cdiv(n, 1024),)](gate, up, out, n, BLOCK=1024, READ=_READ, LATER=_LATER)
    return out
