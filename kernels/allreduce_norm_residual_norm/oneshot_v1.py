"""allreduce_norm_residual_norm oneshot_v1 (hand-written): the TP boundary over peer-to-peer loads.

The same function as triton_v1 (model/ops/allreduce_norm_residual_norm.py) on the stacked rank
partials p_0..p_{R-1}:
    x  = bf( ((f32(p_0) + f32(p_1)) + f32(p_2)) + ... )        rank order, FP32, one rounding
    p  = bf( f32(w_post) * (f32(x) * rsqrt(mean(f32(x)^2) + eps)) )
    h' = bf( f32(bf(f32(p) * a)) + f32(bf(f32(h) * b)) )      a = 1/sqrt(d), b = sqrt((d-1)/d)
    n  = bf( f32(w_next) * (f32(h') * rsqrt(mean(f32(h')^2) + eps)) )
with triton_v1's row program and reduction layout (torch's CUDA last-dim sum, bitwise on the GPU).
The partials need not be one tensor: the program reads rank r's row through its own base pointer,
so each rank of a TP group reads its peers' partials where they lie, in their buffers mapped into
its address space (CUDA IPC over NVLink), and no all-gather runs. The rounded rank sum x is kept
in the `normed` output row between the passes (it is exactly bf16), so each partial is read once.

Distributed use (model/p2p.py owns the buffers; every rank calls the two launchers in turn):
    publish(...)          rank i, row t: e = epochs[t] + 1; copy its partial row into its buffer
                          slot e % 2; a CTA barrier and a system-scope fence; then
                          flags_j[i, t] = e in every rank j's flags (relaxed stores, in flight
                          together)
    boundary_peers(...)   rank i, row t: poll flags_i[:, t] until every rank's is >= epochs[t]
                          (volatile loads, then a system-scope fence: an acquire), then the row
                          program above over the R buffers' slot e % 2
    allreduce_peers(...)  the same wait, then only the rank sum x (an all-reduce of [T, H])
Epochs live on the device, one per row, so a captured CUDA graph replays correctly. Two slots make
one barrier per call enough: rank i rewrites slot s of row t only two calls of that row later,
after its own wait in the call between, which needed every peer's publish of that call, which each
peer issued after finishing its read of slot s. A wait longer than SPIN_LIMIT polls means a peer
never published (it diverged from the others): the rank sets status[0] and, on the GPU, traps, so
the error surfaces instead of wrong numbers. Nothing here uses NVLink multicast.
Memory traffic per rank: read R*T*H bf16 (R-1 of them over NVLink) + T*H (residual) + 2*H, write
3*T*H bf16 (+T*H for the publish copy); R*T flag stores, R*T flag polls.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

LANGUAGE = "triton"
# The reduction layout is fixed by the numerics (it must be torch's); warps and how many chunks
# are loaded per loop iteration are free, as in triton_v1.
CONFIG_SPACE = {"num_warps": [1, 2, 4, 8, 16], "UNROLL": [1, 2, 4, 8]}
DEFAULT_CONFIG: dict = {}
MAX_RANKS = 8  # pointer arguments of the kernels; a larger group falls back to NCCL
_FLAG_LANES = tl.constexpr(MAX_RANKS)  # the wait polls every rank's flag of a row at once
# Polls of a flag before a rank gives up on a peer (about a minute or more on an H200).
SPIN_LIMIT = 1 << 28
_TORCH_MAX_THREADS = 512  # Reduce.cuh max_reduce_threads for FP32
_COPY_BLOCK = 1024


# ---- numerics (triton_v1's helpers) ----------------------------------------------------------
@triton.jit
def _bf16_to_f32(x):
    # Exact widening through the bit pattern (the interpreter's float cast mishandles subnormals).
    return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _f32_to_bf16(x):
    # Round to nearest even on the bits: the interpreter's `.to(tl.bfloat16)` truncates.
    bits = x.to(tl.uint32, bitcast=True)
    hi = bits >> 16
    carry = ((bits & 0xFFFF) + 0x7FFF + (hi & 1)) >> 16  # no uint32 overflow, even for NaNs
    return tl.where(x != x, 0x7FC0, hi + carry).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _pick(r: tl.constexpr, p0, p1, p2, p3, p4, p5, p6, p7):
    # Rank r's base pointer (r is a compile-time constant: no pointer table in memory).
    if r == 0:
        return p0
    elif r == 1:
        return p1
    elif r == 2:
        return p2
    elif r == 3:
        return p3
    elif r == 4:
        return p4
    elif r == 5:
        return p5
    elif r == 6:
        return p6
    else:
        return p7


@triton.jit
def _rank_sum(p0, p1, p2, p3, p4, p5, p6, p7, base, o, m, R: tl.constexpr):
    # FP32 in rank order, rounded once to bf16 (then widened back, exactly).
    acc = _bf16_to_f32(tl.load(p0 + base + o, mask=m, other=0.0))
    for r in tl.static_range(1, R):
        ptr = _pick(r, p0, p1, p2, p3, p4, p5, p6, p7)
        acc = acc + _bf16_to_f32(tl.load(ptr + base + o, mask=m, other=0.0))
    return _bf16_to_f32(_f32_to_bf16(acc))


@triton.jit
def _mul(a, b, ON_GPU: tl.constexpr):
    if ON_GPU:
        return libdevice.mul_rn(a, b)  # never contracted into an FMA
    else:
        return a * b


@triton.jit
def _halve(v, N: tl.constexpr):
    # One level of the lane tree: v[t] + v[t + N/2] for t < N/2.
    lo, hi = tl.split(tl.permute(tl.reshape(v, [2, N // 2]), [1, 0]))
    return lo + hi


@triton.jit
def _lane_tree(acc, TX: tl.constexpr):
    # acc [TX, 4]: combine the four accumulators in order, then halve TX down to one lane.
    even, odd = tl.split(tl.reshape(acc, [TX, 2, 2]))
    a0, a2 = tl.split(even)
    a1, a3 = tl.split(odd)
    v = ((a0 + a1) + a2) + a3
    if TX >= 512:
        v = _halve(v, 512)
    if TX >= 256:
        v = _halve(v, 256)
    if TX >= 128:
        v = _halve(v, 128)
    if TX >= 64:
        v = _halve(v, 64)
    if TX >= 32:
        v = _halve(v, 32)
    if TX >= 16:
        v = _halve(v, 16)
    if TX >= 8:
        v = _halve(v, 8)
    if TX >= 4:
        v = _halve(v, 4)
    if TX >= 2:
        v = _halve(v, 2)
    return v  # [1]


@triton.jit
def _lane_offsets(TX: tl.constexpr, VEC: tl.constexpr):
    # Element of lane t, accumulator i inside one chunk of 4*TX elements.
    t = tl.arange(0, TX)[:, None]
    i = tl.arange(0, 4)[None, :]
    if VEC == 4:
        return t * 4 + i  # float4 vector t: accumulator i holds component i
    else:
        return i * TX + t  # unvectorized: accumulator i holds every 4th stride-TX element


@triton.jit
def _inv_rms(total, inv_n, n, eps, ON_GPU: tl.constexpr):
    if ON_GPU:
        mean = libdevice.mul_rn(total, inv_n)  # torch's CUDA mean: sum * f32(1/N)
        return libdevice.rsqrt(libdevice.add_rn(mean, eps))
    else:
        mean = tl.div_rn(total, n * 1.0)  # torch's CPU mean: sum / N
        return tl.rsqrt(mean + eps)


# ---- the barrier -------------------------------------------------------------------------------
@triton.jit
def _trap(v):
    # Aborts the kernel: the launch fails and the rank's next CUDA call raises.
    return tl.inline_asm_elementwise("trap; mov.b32 $0, $1;", "=r,r", [v], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _fence_sys(v, ON_GPU: tl.constexpr):
    # fence.acq_rel.sys: with the relaxed flag accesses around it, a release (publish) or an
    # acquire (wait) pattern at system scope. The interpreter runs in program order.
    if ON_GPU:
        tl.inline_asm_elementwise("fence.acq_rel.sys; mov.b32 $0, $1;", "=r,r", [v],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _wait_row(flags_ptr, status_ptr, row, cap, e, R: tl.constexpr, SPIN_LIMIT: tl.constexpr,
              ON_GPU: tl.constexpr):
    # Until every rank r has published row `row` of epoch e: flags[r, row] >= e. All R flags are
    # polled at once (volatile loads: relaxed at system scope), then one fence makes it an
    # acquire; the CTA barrier orders every thread's loads of the partials after it.
    r = tl.arange(0, _FLAG_LANES)
    ptrs = flags_ptr + r * cap + row
    live = r < R
    v = tl.where(live, tl.load(ptrs, mask=live, other=0, volatile=True), e)
    n = 0
    while (tl.min(v, axis=0) < e) & (n < SPIN_LIMIT):
        v = tl.where(live, tl.load(ptrs, mask=live, other=0, volatile=True), e)
        n += 1
    late = tl.sum(tl.where(v < e, 1 << r, 0), axis=0)
    if late != 0:
        tl.atomic_or(status_ptr, late.to(tl.int32))
        if ON_GPU:
            _trap(late.to(tl.int32))
    _fence_sys(late.to(tl.int32), ON_GPU)
    tl.debug_barrier()


@triton.jit
def _allreduce_norm_residual_norm_publish_kernel(
    part_ptr, data_ptr, epochs_ptr, f0, f1, f2, f3, f4, f5, f6, f7,
    stride_part, slot_stride, cap, rank,
    N: tl.constexpr, BLOCK: tl.constexpr, R: tl.constexpr, ON_GPU: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    e = tl.load(epochs_ptr + row) + 1
    tl.store(epochs_ptr + row, e)
    src = part_ptr + row * stride_part
    dst = data_ptr + (e & 1) * slot_stride + row * N
    for k in range(0, N, BLOCK):
        o = k + tl.arange(0, BLOCK)
        m = o < N
        tl.store(dst + o, tl.load(src + o, mask=m), mask=m)
    # Every thread's copy is done (CTA barrier), then one fence: the relaxed flag stores after it
    # publish the row, and need not wait for each other.
    tl.debug_barrier()
    _fence_sys(e.to(tl.int32), ON_GPU)
    for r in tl.static_range(R):
        f = _pick(r, f0, f1, f2, f3, f4, f5, f6, f7)
        tl.atomic_xchg(f + rank * cap + row, e, sem="relaxed", scope="sys")


# ---- the row programs ----------------------------------------------------------------------------
@triton.jit
def _row_base(flags_ptr, epochs_ptr, status_ptr, row, stride_branch, slot_stride, cap,
              R: tl.constexpr, PEERS: tl.constexpr, SPIN_LIMIT: tl.constexpr,
              ON_GPU: tl.constexpr):
    # Offset of this row's partial from each rank's base pointer (after the wait, for peers).
    if PEERS:
        e = tl.load(epochs_ptr + row)
        _wait_row(flags_ptr, status_ptr, row, cap, e, R, SPIN_LIMIT, ON_GPU)
        return (e & 1) * slot_stride + row * stride_branch
    else:
        return row * stride_branch


@triton.jit
def _allreduce_norm_residual_norm_fwd_kernel(
    p0, p1, p2, p3, p4, p5, p6, p7, flags_ptr, epochs_ptr, status_ptr,
    res_ptr, post_w_ptr, next_w_ptr, normed_ptr, new_res_ptr,
    stride_branch, slot_stride, cap, stride_res, stride_normed, stride_new_res,
    inv_n, eps, scale_a, scale_b,
    N: tl.constexpr, TX: tl.constexpr, VEC: tl.constexpr, NCHUNK: tl.constexpr,
    UNROLL: tl.constexpr, R: tl.constexpr, ON_GPU: tl.constexpr, PEERS: tl.constexpr,
    SPIN_LIMIT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = _row_base(flags_ptr, epochs_ptr, status_ptr, row, stride_branch, slot_stride, cap,
                     R, PEERS, SPIN_LIMIT, ON_GPU)
    res_row = res_ptr + row * stride_res
    new_res_row = new_res_ptr + row * stride_new_res
    normed_row = normed_ptr + row * stride_normed
    offs = _lane_offsets(TX, VEC)

    # Pass 1: the rank sum x (kept in the normed row) and its sum of squares, chunks in order.
    acc = tl.zeros([TX, 4], dtype=tl.float32)
    for k0 in range(0, NCHUNK, UNROLL):
        for u in tl.static_range(UNROLL):
            o = (k0 + u) * (4 * TX) + offs
            m = o < N
            x = _rank_sum(p0, p1, p2, p3, p4, p5, p6, p7, base, o, m, R)
            tl.store(normed_row + o, _f32_to_bf16(x), mask=m)
            acc = acc + _mul(x, x, ON_GPU)
    r_post = _inv_rms(_lane_tree(acc, TX), inv_n, N, eps, ON_GPU)

    tl.debug_barrier()  # x is re-read below
    acc = tl.zeros([TX, 4], dtype=tl.float32)
    for k0 in range(0, NCHUNK, UNROLL):
        for u in tl.static_range(UNROLL):
            o = (k0 + u) * (4 * TX) + offs
            m = o < N
            x = _bf16_to_f32(tl.load(normed_row + o, mask=m, other=0.0))
            w = _bf16_to_f32(tl.load(post_w_ptr + o, mask=m, other=0.0))
            h = _bf16_to_f32(tl.load(res_row + o, mask=m, other=0.0))
            p = _bf16_to_f32(_f32_to_bf16(w * (x * r_post)))
            pa = _bf16_to_f32(_f32_to_bf16(p * scale_a))
            hb = _bf16_to_f32(_f32_to_bf16(h * scale_b))
            h_new = _f32_to_bf16(pa + hb)
            tl.store(new_res_row + o, h_new, mask=m)
            hf = _bf16_to_f32(h_new)
            acc = acc + _mul(hf, hf, ON_GPU)
    r_next = _inv_rms(_lane_tree(acc, TX), inv_n, N, eps, ON_GPU)

    # Makes this CTA's writes of h' visible to all its threads before they are re-read.
    tl.debug_barrier()
    for k0 in range(0, NCHUNK, UNROLL):
        for u in tl.static_range(UNROLL):
            o = (k0 + u) * (4 * TX) + offs
            m = o < N
            hf = _bf16_to_f32(tl.load(new_res_row + o, mask=m, other=0.0))
            w = _bf16_to_f32(tl.load(next_w_ptr + o, mask=m, other=0.0))
            tl.store(normed_row + o, _f32_to_bf16(w * (hf * r_next)), mask=m)


@triton.jit
def _allreduce_norm_residual_norm_rowsum_kernel(
    p0, p1, p2, p3, p4, p5, p6, p7, flags_ptr, epochs_ptr, status_ptr, out_ptr,
    stride_branch, slot_stride, cap, stride_out,
    N: tl.constexpr, BLOCK: tl.constexpr, R: tl.constexpr, ON_GPU: tl.constexpr,
    PEERS: tl.constexpr, SPIN_LIMIT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = _row_base(flags_ptr, epochs_ptr, status_ptr, row, stride_branch, slot_stride, cap,
                     R, PEERS, SPIN_LIMIT, ON_GPU)
    for k in range(0, N, BLOCK):
        o = k + tl.arange(0, BLOCK)
        m = o < N
        x = _rank_sum(p0, p1, p2, p3, p4, p5, p6, p7, base, o, m, R)
        tl.store(out_ptr + row * stride_out + o, _f32_to_bf16(x), mask=m)


# ---- launchers -----------------------------------------------------------------------------------
def _last_pow2(n: int) -> int:
    return max(1, 1 << (max(n, 1).bit_length() - 1))


def torch_reduce_layout(rows: int, n: int) -> tuple[int, int]:
    """(lanes per row, vector width) of torch's CUDA FP32 sum over the last dim of [rows, n]
    (Reduce.cuh `setReduceConfig`, as in triton_v1)."""
    vec = 4 if n >= 128 else 1
    dim0 = max(n // vec, 1)
    d0 = _TORCH_MAX_THREADS if dim0 >= _TORCH_MAX_THREADS else _last_pow2(dim0)
    d1 = _TORCH_MAX_THREADS if rows >= _TORCH_MAX_THREADS else _last_pow2(rows)
    height = min(d1, _TORCH_MAX_THREADS // min(d0, 32))
    return min(d0, _TORCH_MAX_THREADS // height), vec


def default_unroll(tx: int, nchunk: int) -> int:
    # About 2048 elements in flight per iteration, never more chunks than the row has.
    return max(1, min(8, 2048 // (4 * tx), nchunk))


def _unroll(tx: int, nchunk: int, peers: bool) -> int:
    # Reading peers, a chunk's loads cross NVLink: short rows keep all their chunks in flight.
    return max(default_unroll(tx, nchunk), min(8, nchunk)) if peers else default_unroll(tx, nchunk)


def _padded(ptrs: list) -> list:
    if not 1 <= len(ptrs) <= MAX_RANKS:
        raise ValueError(f"oneshot_v1 reads 1..{MAX_RANKS} ranks' partials, got {len(ptrs)}")
    return list(ptrs) + [ptrs[0]] * (MAX_RANKS - len(ptrs))


def _check_norm_args(h: int, t: int, residual, post_weight, next_weight, device) -> None:
    shapes = (f"residual {tuple(residual.shape)}, post_weight {tuple(post_weight.shape)}, "
              f"next_weight {tuple(next_weight.shape)}")
    if residual.shape != (t, h) or post_weight.shape != (h,) or next_weight.shape != (h,):
        raise ValueError(f"allreduce_norm_residual_norm expects residual[{t},{h}] and weights "
                         f"[{h}]; got {shapes}")
    tensors = (residual, post_weight, next_weight)
    if any(x.dtype != torch.bfloat16 for x in tensors):
        raise ValueError(f"expects bf16 tensors; got {[str(x.dtype) for x in tensors]}")
    if any(x.stride(-1) != 1 for x in tensors):
        raise ValueError(f"needs unit stride along H ({shapes}): pass .contiguous() tensors")
    if any(x.device != device for x in tensors):
        raise ValueError(f"all inputs must be on {device}; got {[x.device for x in tensors]}")


def _norm_launch(ptrs, sync, stride_branch: int, slot_stride: int, cap: int, residual,
                 post_weight, next_weight, add_index: int, eps: float, peers: bool,
                 spin_limit: int, config: dict):
    """The row program over R base pointers; sync = (flags, epochs, status) tensors."""
    if add_index < 2:
        raise ValueError(f"add_index must be >= 2 (2(L+1) or 2(L+1)+1), got {add_index}")
    t, h = residual.shape
    normed = torch.empty_like(residual)
    new_res = torch.empty_like(residual)
    if t == 0 or h == 0:
        return normed, new_res
    tx, vec = torch_reduce_layout(t, h)
    inv_n = float(np.float32(1.0) / np.float32(h))
    # Python floats, rounded to FP32 at launch: torch's bf16-tensor-times-scalar does the same.
    scale_a, scale_b = 1.0 / math.sqrt(add_index), math.sqrt((add_index - 1) / add_index)
    nchunk = triton.cdiv(h, 4 * tx)
    _allreduce_norm_residual_norm_fwd_kernel[(t,)](
        *_padded(ptrs), *sync, residual, post_weight, next_weight, normed, new_res,
        stride_branch, slot_stride, cap, residual.stride(0), normed.stride(0), new_res.stride(0),
        inv_n, eps, scale_a, scale_b,
        N=h, TX=tx, VEC=vec, NCHUNK=nchunk,
        UNROLL=config.get("UNROLL") or _unroll(tx, nchunk, peers), R=len(ptrs),
        ON_GPU=residual.is_cuda, PEERS=peers, SPIN_LIMIT=spin_limit,
        num_warps=config.get("num_warps") or max(1, min(16, tx // 32)),
    )
    return normed, new_res


def _unused_sync(device) -> tuple:
    return (torch.zeros(1, dtype=torch.int64, device=device),
            torch.zeros(1, dtype=torch.int64, device=device),
            torch.zeros(1, dtype=torch.int32, device=device))


def allreduce_norm_residual_norm_fwd(partials, residual, post_weight, next_weight,
                                     add_index: int, eps: float, config: dict | None = None):
    """The stacked form (partials [R, T, H]): each rank's row read through its own pointer."""
    if partials.dim() != 3 or not 1 <= partials.shape[0] <= MAX_RANKS:
        raise ValueError(f"allreduce_norm_residual_norm expects partials[R,T,H] with 1 <= R <= "
                         f"{MAX_RANKS}; got {tuple(partials.shape)}")
    if partials.dtype != torch.bfloat16 or partials.stride(-1) != 1:
        raise ValueError(f"partials must be bf16 with unit stride along H; got {partials.dtype}, "
                         f"strides {partials.stride()}")
    r, t, h = partials.shape
    _check_norm_args(h, t, residual, post_weight, next_weight, partials.device)
    ptrs = [partials[i] for i in range(r)]
    return _norm_launch(ptrs, _unused_sync(partials.device), partials.stride(1), 0, 1, residual,
                        post_weight, next_weight, add_index, eps, False, 1, config or {})


# ---- the peer-to-peer entry points (model/p2p.py) ---------------------------------------------
def _check_buffers(data, flags, epochs, status, tokens: int) -> tuple[int, int]:
    """(capacity, H) of the rank buffers; ValueError naming what does not fit."""
    if not 1 <= len(data) <= MAX_RANKS:
        raise ValueError(f"oneshot_v1 reads 1..{MAX_RANKS} ranks' buffers, got {len(data)}")
    first = data[0]
    if first.dim() != 3 or first.shape[0] != 2:
        raise ValueError(f"rank buffers must be [2, capacity, H] (two slots); got "
                         f"{tuple(first.shape)}")
    _, cap, h = first.shape
    for b in data:
        if b.shape != first.shape or b.dtype != torch.bfloat16 or not b.is_contiguous():
            raise ValueError(f"every rank buffer must be a contiguous bf16 [2, {cap}, {h}]; got "
                             f"{tuple(b.shape)} {b.dtype}")
    if flags.shape != (len(data), cap) or flags.dtype != torch.int64:
        raise ValueError(f"flags must be int64 [{len(data)}, {cap}], got {tuple(flags.shape)} "
                         f"{flags.dtype}")
    if epochs.shape != (cap,) or epochs.dtype != torch.int64:
        raise ValueError(f"epochs must be int64 [{cap}], got {tuple(epochs.shape)} {epochs.dtype}")
    if status.shape != (1,) or status.dtype != torch.int32:
        raise ValueError(f"status must be int32 [1], got {tuple(status.shape)} {status.dtype}")
    if not 0 <= tokens <= cap:
        raise ValueError(f"{tokens} tokens do not fit buffers of {cap} rows")
    return cap, h


def publish(partial, data, flags: list, epochs, rank: int) -> None:
    """Copy this rank's partial [T, H] into its buffer `data` (slot e % 2 of each row) and set
    flags[r][rank, t] = e in every rank r's flags (peers' flags mapped into this process)."""
    cap, h = data.shape[1], data.shape[2]
    t = partial.shape[0]
    if partial.shape != (t, h) or partial.dtype != torch.bfloat16 or partial.stride(-1) != 1:
        raise ValueError(f"partial must be bf16 [T, {h}] with unit stride; got "
                         f"{tuple(partial.shape)} {partial.dtype}")
    if not 0 <= rank < len(flags) or not 0 < t <= cap:
        raise ValueError(f"rank {rank} of {len(flags)}, {t} tokens, capacity {cap}")
    _allreduce_norm_residual_norm_publish_kernel[(t,)](
        partial, data, epochs, *_padded(list(flags)), partial.stride(0), cap * h, cap, rank,
        N=h, BLOCK=min(_COPY_BLOCK, triton.next_power_of_2(h)), R=len(flags),
        ON_GPU=partial.is_cuda, num_warps=4)


def boundary_peers(data: list, flags, epochs, status, residual, post_weight, next_weight,
                   add_index: int, eps: float, config: dict | None = None,
                   spin_limit: int = SPIN_LIMIT):
    """The boundary of the rows every rank has published: (normed_next, new_residual)."""
    cap, h = _check_buffers(data, flags, epochs, status, residual.shape[0])
    _check_norm_args(h, residual.shape[0], residual, post_weight, next_weight, residual.device)
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    return _norm_launch(list(data), (flags, epochs, status), h, cap * h, cap, residual,
                        post_weight, next_weight, add_index, eps, True, spin_limit, cfg)


def allreduce_peers(data: list, flags, epochs, status, tokens: int,
                    spin_limit: int = SPIN_LIMIT):
    """The rank sum alone of the first `tokens` published rows: bf16 [tokens, H]."""
    cap, h = _check_buffers(data, flags, epochs, status, tokens)
    out = torch.empty((tokens, h), dtype=torch.bfloat16, device=data[0].device)
    if tokens == 0:
        return out
    _allreduce_norm_residual_norm_rowsum_kernel[(tokens,)](
        *_padded(list(data)), flags, epochs, status, out, h, cap * h, cap, out.stride(0),
        N=h, BLOCK=min(_COPY_BLOCK, triton.next_power_of_2(h)), R=len(data),
        ON_GPU=out.is_cuda, PEERS=True, SPIN_LIMIT=spin_limit, num_warps=4)
    return out


def run(partials, residual, post_weight, next_weight, add_index: int, eps: float,
        config: dict | None = None):
    """allreduce_norm_residual_norm(...) -> (normed_next[T,H], new_residual[T,H]), both bf16."""
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    return allreduce_norm_residual_norm_fwd(partials, residual, post_weight, next_weight,
                                            add_index, eps, cfg)
