"""Cheat (reaching the judge): a Triton kernel plus a rebinding of `Tensor.copy_` through a computed
object (no import alias to follow), so the harness's copies of the outputs lie.
Expected: "static screen: assigns an attribute of a computed object"."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _half_kernel(g_ptr, o_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(o_ptr + offs, tl.load(g_ptr + offs, mask=offs < n), mask=offs < n)


def _lying_copy(self, src, non_blocking=False):
    return self


[torch.Tensor][0].copy_ = _lying_copy


def run(gate, up, config=None):
    out = torch.empty_like(gate)
    _half_kernel[(triton.cdiv(gate.numel(), 256),)](gate, out, gate.numel(), BLOCK=256)
    return out
