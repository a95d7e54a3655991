"""Helpers shared by the template families (tiles, rows): BF16 conversions and exp.

Text between a `# {{snippet NAME}}` line and the next `# {{end}}` is section NAME; a
template line `# {{common.NAME}}` is replaced by it, byte for byte, when template.py renders a
variant, so every rendered variant stays self-contained (its sha256 pins all the code it runs; it
imports neither autoopt nor another variant). Lines outside the sections (this docstring, the
imports, the comments above each section) are never rendered.
Editing a section changes the bytes, hence the sha256, of every variant rendered from a template
that uses it: the registry then holds it as new code, to be verified again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


# Exact BF16 -> FP32 widening through the bit pattern.
# {{snippet bf16_to_f32}}
@triton.jit
def _bf16_to_f32(x):
    return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
# {{end}}


# FP32 -> BF16 round to nearest even on the bits (NaN -> the canonical quiet NaN).
# The rowsum family has its own, equal-valued form (_rowsum.py).
# {{snippet f32_to_bf16}}
@triton.jit
def _f32_to_bf16(x):
    # Round to nearest even on the bits: the interpreter's `.to(tl.bfloat16)` truncates.
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    rounded = tl.where(x != x, 0x7FC00000, rounded)
    return (rounded >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
# {{end}}


# expf as torch computes it: libdevice's on the GPU, FP64 rounded in the interpreter.
# {{snippet exp}}
@triton.jit
def _exp(x, ON_GPU: tl.constexpr):
    if ON_GPU:
        return libdevice.exp(x)  # __nv_expf, the expf torch's CUDA kernels call
    else:
        return tl.exp(x.to(tl.float64)).to(tl.float32)
# {{end}}


# A BF16 x BF16 -> FP32 tile product. The interpreter misreads BF16 tl.dot operands, so there
# the exactly widened FP32 values are multiplied in IEEE FP32 (BF16 products are exact in FP32).
# Needs bf16_to_f32 above it.
# {{snippet dot}}
@triton.jit
def _dot(a, b, ON_GPU: tl.constexpr):
    if ON_GPU:
        return tl.dot(a, b)
    else:
        return tl.dot(_bf16_to_f32(a), _bf16_to_f32(b), input_precision="ieee")
# {{end}}


# The split-K epilogue of the GEMV families: with one split the FP32 tile is rounded and stored;
# otherwise the partial goes to part_ptr ([SPLIT_K, T, N] FP32), and the last of the SPLIT_K
# programs of N tile `tile` (an atomic ticket, taken after its partial is stored) sums the
# partials in split order, rounds once and re-arms the ticket: one launch, deterministic.
# Needs f32_to_bf16 above it.
# {{snippet splitk_store}}
@triton.jit
def _splitk_store(acc, out_ptr, part_ptr, ticket_ptr, tile, split, rows, cols, omask, T, N,
                  SPLIT_K: tl.constexpr):
    out = out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
    if SPLIT_K == 1:
        tl.store(out, _f32_to_bf16(acc), mask=omask)
    else:
        part = part_ptr + (split * T + rows[:, None]).to(tl.int64) * N + cols[None, :]
        tl.store(part, acc, mask=omask)
        tl.debug_barrier()  # every thread's partial is stored before the ticket is taken
        ticket = tl.atomic_add(ticket_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT_K - 1:  # the last split of this tile: sum in split order, round once
            first = part_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
            total = tl.load(first, mask=omask, other=0.0, cache_modifier=".cg")
            for i in tl.static_range(1, SPLIT_K):
                total += tl.load(first + i * T * N, mask=omask, other=0.0, cache_modifier=".cg")
            tl.store(out, _f32_to_bf16(total), mask=omask)
            tl.atomic_xchg(ticket_ptr + tile, 0)  # ready for the next call (and graph replay)
# {{end}}


# The tickets of splitk_store, one int32 per N tile.
# {{snippet tickets}}
_TICKETS: dict[tuple[str, int], torch.Tensor] = {}


def _tickets(device: torch.device, n: int) -> torch.Tensor:
    # Zeroed once per (device, size), reset by the kernel itself: no memset launch per call, and
    # a captured CUDA graph keeps the pointer it recorded.
    key = (str(device), n)
    if key not in _TICKETS:
        _TICKETS[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return _TICKETS[key]
# {{end}}
