"""moe_experts grouped_mm_v1 (hand-written, torch): the contract with static shapes, capturable.

Formula (docs/numerics.md "MoE combine"): the (token, slot) pairs sorted by expert (a stable argsort
of the local expert id; pairs naming experts held elsewhere sort last, past every group), then
    gu = bf( grouped_mm(x[pairs], gate_up^T) )       one BF16 rounding per GEMM output
    a  = bf( silu(f32(gu[:I])) * f32(gu[I:]) )        torch's silu, one rounding
    d  = bf( grouped_mm(a, down^T) )                  rows past the held groups forced to zero
and the reference combine: y = bf( sum_k f32(d_k) * w_k ) in torch's dim-1 order, out =
bf( f32(y) * scale ). The layout of transformers' `grouped_mm` experts backend; no host sync
(offsets stay on the device), so CUDA graphs can capture it. On the CPU torch's grouped_mm runs
the same per-group GEMMs as the reference's F.linear (bitwise there); on CUDA the GEMMs' K order
is cuBLAS's grouped kernel's (the op's ulp policy).
Kernels: ~12 launches (sort, counts, gather, two grouped GEMMs, SwiGLU, scatter, combine).
Memory traffic: the hit experts' weights once, plus T*k*(H + 2I + H) bf16 of gathered rows,
activations and slot outputs, and the FP32 [T,k,H] combine products.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LANGUAGE = "torch"
CONFIG_SPACE: dict = {}
DEFAULT_CONFIG: dict = {}

# torch's public grouped GEMM (torch >= 2.10; the registry records the torch it was verified on).
_grouped_mm = F.grouped_mm


def _check(x, gate_up, down, weights, ids) -> None:
    shapes = (f"x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)}, "
              f"weights {tuple(weights.shape)}, ids {tuple(ids.shape)}")
    if x.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3 or ids.dim() != 2:
        raise ValueError(f"moe_experts expects x[T,H], gate_up[E,2I,H], down[E,H,I], "
                         f"weights[T,k], ids[T,k]; got {shapes}")
    (t, h), (e, i2, h2), k = x.shape, gate_up.shape, ids.shape[1]
    if h2 != h or i2 % 2 or down.shape != (e, h, i2 // 2) or weights.shape != (t, k) \
            or ids.shape[0] != t:
        raise ValueError(f"moe_experts shapes disagree: {shapes}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"moe_experts expects integer ids; got {ids.dtype}")


def sort_pairs(ids: torch.Tensor, e: int, offset: int) -> tuple:
    """(order, held, offs): pair indices sorted by local expert (stable; experts held elsewhere
    last), which pairs are held here, and the int32 end offset of each expert's group."""
    local = (ids - offset).reshape(-1)
    held = (local >= 0) & (local < e)
    key = torch.where(held, local, e)
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(e + 1, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(0, key, torch.ones_like(key, dtype=torch.int32))
    return order, held, counts[:e].cumsum(0, dtype=torch.int32)


def _pad_to(n: int, multiple: int = 8) -> int:
    return -(-n // multiple) * multiple


def aligned(x, gate_up, down) -> tuple:
    """grouped_mm needs 16-byte strides (8 BF16 elements). Real widths (H=5120, I=320) already
    are; other widths get zero padding, which adds exact zeros to every FP32 sum (the same
    numbers), at the cost of a copy of the weights."""
    h, i = x.shape[1], down.shape[2]
    hp, ip = _pad_to(h), _pad_to(i)
    if (hp, ip) == (h, i):
        return x, gate_up, down
    e = gate_up.shape[0]
    xp = x.new_zeros(x.shape[0], hp)
    xp[:, :h] = x
    gup = gate_up.new_zeros(e, 2 * ip, hp)
    gup[:, :i, :h] = gate_up[:, :i]
    gup[:, ip:ip + i, :h] = gate_up[:, i:]
    dp = down.new_zeros(e, hp, ip)
    dp[:, :h, :i] = down
    return xp, gup, dp


def run(x, gate_up, down, weights, ids, scale: float, expert_offset: int = 0,
        config: dict | None = None) -> torch.Tensor:
    """moe_experts(x[T,H], gate_up[E,2I,H], down[E,H,I], weights[T,k] fp32, ids[T,k], scale,
    expert_offset=0) -> [T,H] in x's dtype."""
    _check(x, gate_up, down, weights, ids)
    t, k = ids.shape
    e, h = gate_up.shape[0], x.shape[1]
    if t * k == 0 or e == 0:
        return torch.zeros_like(x)
    order, held, offs = sort_pairs(ids, e, int(expert_offset))
    xa, gate_up, down = aligned(x, gate_up, down)
    xs = xa[order // k]  # [T*k, H], grouped by expert
    gu = _grouped_mm(xs, gate_up.transpose(1, 2), offs=offs)  # [T*k, 2I]
    inter = gu.shape[1] // 2
    act = (F.silu(gu[:, :inter].float()) * gu[:, inter:].float()).to(x.dtype)
    d = _grouped_mm(act, down.transpose(1, 2), offs=offs)
    # Rows past offs[-1] (experts held elsewhere) are left unwritten by grouped_mm: zero them.
    d = torch.where(held[order][:, None], d, torch.zeros((), dtype=d.dtype, device=d.device))
    slots = torch.empty_like(d).index_copy_(0, order, d)[:, :h].reshape(t, k, h)
    # BF16 d_k times FP32 w_k promotes to FP32; torch's dim-1 sum; one rounding; then x scale.
    return (slots * weights.unsqueeze(-1)).sum(dim=1).to(x.dtype) * scale
