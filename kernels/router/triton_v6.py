"""router triton_v6 (hand-written): triton_v5 with the tile sizes an H100 tune chose as its
defaults: the FP32 GEMM on BF16 tensor cores, exactly, from 5 tokens (triton_v5: from 17).

triton_v5 ran triton_v4's FMA GEMV up to 16 tokens, 18 us at T = 8 and 16 on an H100, where the
three-term tiles below (16 tokens x 32 experts, 128-deep K steps, 4 warps) take 7 us; from 17 to
32 tokens 32 x 64 tiles take 8.7 us against 32 x 32's 10.9. Those were tuned in as configs keyed
to that GPU; as defaults every GPU without tuned configs runs them. Kernels, selection and
rounding are triton_v5's (with the same config the outputs are its, bit for bit); what follows
is triton_v5's account of them.

triton_v5: triton_v4 (a GEMV, a bitonic top-k selection within warps), with the FP32 GEMM on
BF16 tensor cores, exactly.

From 17 to 64 tokens triton_v4 computes the logits with FP32 FMAs (`tl.dot`, IEEE), above 64 with
a cast and cuBLAS's FP32 GEMM (three kernels): either way at the CUDA cores' FP32 rate, 5.4 GFLOP
at T = 2048 and H = 5120 (that path took 158 us on an H100, its FLOPs alone ~105 us). The
activations are BF16, so the FP32 products need no FP32 multiplier:
  - each FP32 weight tile, as loaded, is split in registers into three BF16 terms,
    w = w1 + w2 + w3 exactly (w1: w's bits with the low 16 cleared, its top 8 significant bits;
    w2 the same of w - w1; w3 = w - w1 - w2, at most 8 significant bits left). Exact for every
    |w| >= 2**-100 (a term that leaves FP32's normal range loses bits below that);
  - h (BF16) times each term is a BF16 x BF16 product, exact in FP32 (16 significant bits);
    tensor cores (`tl.dot` on BF16 operands, FP32 accumulation) sum each K step's products of
    the three terms, smallest first, from zero, and that sum is added to the tile's total in
    FP32 on the CUDA cores. Tensor cores need not round their sums to nearest (measured ones
    truncate toward zero); through one accumulator over all of K that bias reaches 70-90 ulps
    of the weights in an emulation (`benchmarks/router_tc_rounding.py`), a fresh sum each step
    keeps them within 5, as round-to-nearest sums do. The logits are exact products summed in
    FP32 in another order than cuBLAS's, which the op's policy allows (as every GEMV here);
  - three BF16 tensor-core products a FLOP run at a third of the BF16 rate, several times the
    FP32 FMA rate on Hopper; the weight is read once as FP32 (no second copy in memory), h once
    per expert tile. Two kernels at every T: the GEMM's split-K partials, then the selection.
No TF32 anywhere: TF32 would round the weight to 10 significant bits (a near miss, not this).
Activations in FP16 or FP32 take the FMA tiles instead (their products with a BF16 term are not
what the tensor cores take).
The masked key is the int64 minimum, below the key of every finite c (triton_v3 before used
-2**62, above the keys of c <= -2, and selected masked experts when every bias was that low).
The order is the reference's: c descending, equal values lower expert first; groups likewise.
Everything else is triton_v4's, and with `GEMM` "fma", "dot" or "lib" the outputs are its.

Formula (the router contract, model/ops/router.py):
    logits = f32(h) @ W^T              FP32 products and sums (no TF32)
    s      = 1 / (1 + expf(-logits))   IEEE divide (`div_rn`), libdevice expf on the GPU
    c      = s + bias                  selection only
    group score = sum of the top-2 of c in each of n_group groups; keep the top topk_group groups
    ids    = top_k of c over the kept groups, sorted descending
    w      = s[ids] / (sum(s[ids]) + 1e-20), the sum in torch's CUDA order for 8 values,
             ((w0+w4)+(w2+w6))+((w1+w5)+(w3+w7)) (a halving tree), IEEE divide.
Rounding: FP32 throughout. The GEMM's order is split-K partials added in split order (each
partial a K-ordered chain: FMAs, or tensor-core sums of exact products), not cuBLAS's: logits
differ by a few FP32 ulps, within the op's policy. With `GEMM = "lib"` the logits are the
reference's own FP32 GEMM.
Memory traffic: read 4*E*H (weight) + 2*T*H*ceil(E/BLOCK_E) + 4*E; partials 2 * 4*SPLIT_K*T*E
(L2); write 12*T*top_k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

try:  # programmatic dependent launch (sm_90+); absent from older Tritons, never traced then
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    gdc_launch_dependents = gdc_wait = None

LANGUAGE = "triton"
# Meta-parameters only: every config computes the same selection on FP32 logits whose
# summation order depends on GEMM/SPLIT_K/BLOCK_K (within the policy), never on warps or PDL.
CONFIG_SPACE = {
    "GEMM": ["bf16x3", "fma", "dot", "lib"],
    "BLOCK_E": [2, 4, 8, 16, 32, 64, 128, 256],
    "BLOCK_K": [16, 32, 64, 128, 256, 512],
    "SPLIT_K": [1, 2, 4, 5, 10, 20, 40],
    "BLOCK_T": [1, 2, 4, 8, 16, 32, 64, 128],
    "num_warps": [1, 2, 4, 8],
    "num_stages": [1, 2, 3, 4],
    "SEL": ["topk", "rounds"],
    "SEL_T": [1, 2, 4, 8],
    "SEL_WARPS": [1, 2, 4, 8, 16],
    "PDL": [0, 1],
}
# Unset keys follow `default_config(T)`.
DEFAULT_CONFIG: dict = {}
_NEG_KEY = tl.constexpr(-(2**63))  # below every real key: a finite value's top word is > -2**31


@triton.jit
def _bf16_to_f32(x):
    # Exact widening through the bit pattern (the interpreter's float cast mishandles subnormals).
    return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _sigmoid(logits, ON_GPU: tl.constexpr):
    if ON_GPU:
        e = libdevice.exp(-logits)  # __nv_expf, the expf torch's CUDA sigmoid calls
    else:
        e = tl.exp((-logits).to(tl.float64)).to(tl.float32)  # numpy's FP32 exp is often 1 ulp off
    return tl.div_rn(tl.full(logits.shape, 1.0, tl.float32), 1.0 + e)


@triton.jit
def _halve(v, N: tl.constexpr):
    # One level of the renorm tree on [rows, N]: v[:, i] + v[:, i + N/2] for i < N/2.
    lo, hi = tl.split(tl.permute(tl.reshape(v, [v.shape[0], 2, N // 2]), [0, 2, 1]))
    return lo + hi


@triton.jit
def _tree_sum(v, K: tl.constexpr):
    # torch's CUDA order over 8 values, ((w0+w4)+(w2+w6))+((w1+w5)+(w3+w7)), for any power of 2,
    # on every row of [rows, K].
    if K >= 32:
        v = _halve(v, 32)
    if K >= 16:
        v = _halve(v, 16)
    if K >= 8:
        v = _halve(v, 8)
    if K >= 4:
        v = _halve(v, 4)
    if K >= 2:
        v = _halve(v, 2)
    return tl.reshape(v, [v.shape[0]])


@triton.jit
def _before(cj, ej, ci, ei):
    # j comes before i in the reference's order: the larger value, then the lower index.
    return (cj > ci) | ((cj == ci) & (ej < ei))


@triton.jit
def _key(c, cols, E: tl.constexpr):
    # One int64 per expert ordering by c (monotonic image of the FP32 bits), then lower id first:
    # distinct keys, so a max or a sort on them alone yields both the value and the expert.
    b = c.to(tl.int32, bitcast=True)
    mono = tl.where(b >= 0, b, b ^ 0x7FFFFFFF)
    return (mono.to(tl.int64) << 32) | (E - 1 - cols).to(tl.int64)


@triton.jit
def _unkey(key):
    # c back from its key's top word (`_key`'s image is its own inverse on the FP32 bits).
    mono = (key >> 32).to(tl.int32)
    return tl.where(mono >= 0, mono, mono ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _top_keys(x, K: tl.constexpr):
    # The K largest keys along the last axis, largest first (a bitonic top-k; distinct keys).
    if K == 1:
        return tl.max(x, axis=len(x.shape) - 1, keep_dims=True)
    else:
        return tl.topk(x, K)


@triton.jit
def _router_gemv_kernel(h_ptr, wt_ptr, part_ptr, T, H, stride_h, stride_w,
                        E: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                        BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr, H_BF16: tl.constexpr,
                        PDL: tl.constexpr):
    pe, pk, pt = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    toks = pt * BLOCK_T + tl.arange(0, BLOCK_T)
    exps = pe * BLOCK_E + tl.arange(0, BLOCK_E)
    k_base = pk * (K_STEPS * BLOCK_K)
    h_rows = h_ptr + toks.to(tl.int64)[:, None] * stride_h
    w_rows = wt_ptr + exps.to(tl.int64)[:, None] * stride_w
    tmask = (toks < T)[:, None]
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    if K_STEPS == 1:  # decode: the program's whole weight slice in one load
        ks = k_base + tl.arange(0, BLOCK_K)
        km = (ks < H)[None, :]
        wt = tl.load(w_rows + ks[None, :], mask=km, other=0.0)
        if PDL:
            gdc_launch_dependents()  # the selection's programs may be placed from here on
            gdc_wait()  # the previous kernel's h is complete and visible past this point
        x = tl.load(h_rows + ks[None, :], mask=tmask & km, other=0.0)
        x = _bf16_to_f32(x) if H_BF16 else x.to(tl.float32)
        acc += tl.sum(x[:, None, :] * wt[None, :, :], axis=2)  # FP32 FMAs, no tl.dot
    else:
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        for i in range(K_STEPS):
            ks = k_base + i * BLOCK_K + tl.arange(0, BLOCK_K)
            km = (ks < H)[None, :]
            x = tl.load(h_rows + ks[None, :], mask=tmask & km, other=0.0)
            x = _bf16_to_f32(x) if H_BF16 else x.to(tl.float32)
            wt = tl.load(w_rows + ks[None, :], mask=km, other=0.0)
            acc += tl.sum(x[:, None, :] * wt[None, :, :], axis=2)
    part = part_ptr + pk * T * E + toks.to(tl.int64)[:, None] * E + exps[None, :]
    tl.store(part, acc, mask=tmask)


@triton.jit
def _tile_start(h_ptr, T, stride_h, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr, PDL: tl.constexpr):
    # A tokens x experts tile's K slice (the GEMMs' shared prologue): its indices, the token rows
    # of h, their mask and a zero accumulator; under PDL, released and waiting for h.
    pe, pk, pt = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    toks = pt * BLOCK_T + tl.arange(0, BLOCK_T)
    exps = pe * BLOCK_E + tl.arange(0, BLOCK_E)
    h_rows = h_ptr + toks.to(tl.int64)[:, None] * stride_h
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    return pk, toks, exps, pk * (K_STEPS * BLOCK_K), h_rows, (toks < T)[:, None], acc


@triton.jit
def _store_tile(part_ptr, acc, pk, T, toks, exps, tmask, E: tl.constexpr):
    # The tile's partial logits, at split pk's [T, E] slice (summed in split order later).
    part = part_ptr + pk * T * E + toks.to(tl.int64)[:, None] * E + exps[None, :]
    tl.store(part, acc, mask=tmask & (exps < E)[None, :])


@triton.jit
def _router_dot_kernel(h_ptr, wt_ptr, part_ptr, T, H, stride_h, stride_w,
                       E: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                       BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr, H_BF16: tl.constexpr,
                       PDL: tl.constexpr):
    # Tokens x experts tiles of FP32 FMAs (`tl.dot`, IEEE: no TF32), a K slice per program; the
    # partials in split order as the GEMV's.
    pk, toks, exps, k_base, h_rows, tmask, acc = _tile_start(h_ptr, T, stride_h, BLOCK_T, BLOCK_E,
                                                             BLOCK_K, K_STEPS, PDL)
    w_cols = wt_ptr + exps.to(tl.int64)[None, :] * stride_w
    emask = (exps < E)[None, :]  # a 16-wide tile may pass a smaller E
    for i in range(K_STEPS):
        ks = k_base + i * BLOCK_K + tl.arange(0, BLOCK_K)
        km = ks < H
        x = tl.load(h_rows + ks[None, :], mask=tmask & km[None, :], other=0.0)
        x = _bf16_to_f32(x) if H_BF16 else x.to(tl.float32)
        wt = tl.load(w_cols + ks[:, None], mask=km[:, None] & emask, other=0.0)  # [K, BLOCK_E]
        acc = tl.dot(x, wt, acc, input_precision="ieee")
    _store_tile(part_ptr, acc, pk, T, toks, exps, tmask, E)


@triton.jit
def _split3(w):
    # w = w1 + w2 + w3 exactly, each a BF16 value held in FP32: clearing the low 16 bits keeps
    # the top 8 significant bits (w - w1 is exact: its bits are w's lower ones), twice.
    w1 = (w.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)
    r = w - w1
    w2 = (r.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)
    return w1, w2, r - w2


@triton.jit
def _mma(x, w, acc, ON_GPU: tl.constexpr):
    # acc + x @ w^T, x BF16 [BLOCK_T, K], w one BF16-exact term in FP32 [BLOCK_E, K]. The
    # interpreter misreads BF16 tl.dot operands; FP32 ones hold the same values, and the products
    # of two 8-bit significands are exact either way.
    if ON_GPU:
        return tl.dot(x, tl.trans(w.to(tl.bfloat16)), acc)
    else:
        return tl.dot(_bf16_to_f32(x), tl.trans(w), acc, input_precision="ieee")


@triton.jit
def _router_bf16x3_kernel(h_ptr, wt_ptr, part_ptr, T, H, stride_h, stride_w,
                          E: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                          BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr, ON_GPU: tl.constexpr,
                          PDL: tl.constexpr):
    # Tokens x experts tiles on tensor cores, a K slice per program: each FP32 weight tile split
    # into three BF16 terms (`_split3`), each multiplied by the BF16 activations, the smallest
    # first; the partials in split order as the other GEMMs'.
    pk, toks, exps, k_base, h_rows, tmask, acc = _tile_start(h_ptr, T, stride_h, BLOCK_T, BLOCK_E,
                                                             BLOCK_K, K_STEPS, PDL)
    w_rows = wt_ptr + exps.to(tl.int64)[:, None] * stride_w
    emask = (exps < E)[:, None]  # a 16-wide tile may pass a smaller E
    for i in range(K_STEPS):
        ks = k_base + i * BLOCK_K + tl.arange(0, BLOCK_K)
        km = (ks < H)[None, :]
        x = tl.load(h_rows + ks[None, :], mask=tmask & km, other=0.0)  # BF16
        w1, w2, w3 = _split3(tl.load(w_rows + ks[None, :], mask=emask & km, other=0.0))
        # A fresh tensor-core sum each K step, added to the total on the CUDA cores (FP32, round
        # to nearest): tensor cores need not round their FP32 sums to nearest (V100, T4 and A100
        # were measured to truncate), and one accumulator through all of K would carry that
        # bias to the logits.
        p = _mma(x, w3, tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32), ON_GPU)
        p = _mma(x, w2, p, ON_GPU)
        acc += _mma(x, w1, p, ON_GPU)
    _store_tile(part_ptr, acc, pk, T, toks, exps, tmask, E)


@triton.jit
def _router_select_topk_kernel(part_ptr, bias_ptr, w_out_ptr, id_out_ptr, T,
                               SPLIT: tl.constexpr, E: tl.constexpr, NG: tl.constexpr,
                               TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                               ON_GPU: tl.constexpr, PDL: tl.constexpr):
    # One token a program; [NG, GS] with one expert a thread and a group a warp at 8 warps.
    tok = tl.program_id(0)
    GS: tl.constexpr = E // NG
    CAND: tl.constexpr = max(2, min(TOP_K, GS))  # a group's candidates (and its top-2)
    ex = tl.arange(0, NG)[:, None] * GS + tl.arange(0, GS)[None, :]
    bias = tl.load(bias_ptr + ex)  # not written by the GEMV: before the wait
    if PDL:
        gdc_wait()  # every GEMV program's partials are complete and visible past this point
    row = part_ptr + tok.to(tl.int64) * E + ex
    # Partial sums added in split order; unrolled, so all SPLIT loads are in flight together.
    logits = tl.zeros([NG, GS], dtype=tl.float32)
    for k in tl.static_range(SPLIT):
        logits += tl.load(row + k * T * E)
    s = _sigmoid(logits, ON_GPU)
    top = _top_keys(_key(s + bias, ex, E), CAND)  # [NG, CAND]: each group's first, in order
    # The group's top-2 sum (a repeated maximum counts twice, as torch.topk's values do).
    gsc = tl.sum(tl.where(tl.arange(0, CAND)[None, :] < 2, _unkey(top), 0.0), axis=1)
    ga = tl.arange(0, NG)
    g_place = tl.sum(_before(gsc[None, :], ga[None, :], gsc[:, None], ga[:, None])
                     .to(tl.int32), axis=1)
    cand = tl.where((g_place < TOPK_GROUP)[:, None], top, _NEG_KEY)
    best = tl.reshape(_top_keys(tl.reshape(cand, [1, NG * CAND]), TOP_K), [TOP_K])
    ids = E - 1 - (best & 0xFFFFFFFF).to(tl.int32)
    sw = tl.gather(tl.reshape(s, [E]), ids, 0)
    denom = _tree_sum(tl.reshape(sw, [1, TOP_K]), TOP_K) + 1e-20  # [1]
    w = tl.div_rn(sw, tl.full([TOP_K], 0.0, tl.float32) + denom)
    out = tok.to(tl.int64) * TOP_K + tl.arange(0, TOP_K)
    tl.store(w_out_ptr + out, w)
    tl.store(id_out_ptr + out, ids.to(tl.int64))


# --- the selection by rounds (triton_v3's): less work per token, for many tokens --------------

@triton.jit
def _group_keep(c3, NG: tl.constexpr, TOPK_GROUP: tl.constexpr):
    # Group score = the top-2 of c summed; a repeated maximum counts twice (torch.topk's values).
    m1 = tl.max(c3, axis=2)
    is1 = c3 == m1[:, :, None]
    n1 = tl.sum(is1.to(tl.int32), axis=2)
    m2 = tl.max(tl.where(is1, float("-inf"), c3), axis=2)
    gs = m1 + tl.where(n1 > 1, m1, m2)
    # Keep a group when fewer than TOPK_GROUP groups beat it (ties: the lower group wins).
    ga = tl.arange(0, NG)
    beats = (gs[:, None, :] > gs[:, :, None]) | \
        ((gs[:, None, :] == gs[:, :, None]) & (ga[None, None, :] < ga[None, :, None]))
    return tl.sum(beats.to(tl.int32), axis=2) < TOPK_GROUP


@triton.jit
def _router_select_rounds_kernel(part_ptr, bias_ptr, w_out_ptr, id_out_ptr, T,
                                 SPLIT: tl.constexpr, E: tl.constexpr, NG: tl.constexpr,
                                 TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                                 SEL_T: tl.constexpr, ON_GPU: tl.constexpr, PDL: tl.constexpr):
    # SEL_T tokens a program, in registers: the group stage on [SEL_T, NG, GS], then the top-k
    # by TOP_K rounds of one packed int64 max (value, then lower expert).
    GS: tl.constexpr = E // NG
    toks = tl.program_id(0) * SEL_T + tl.arange(0, SEL_T)
    cols = tl.arange(0, E)[None, :]
    m = (toks < T)[:, None]
    bias = tl.load(bias_ptr + cols)
    if PDL:
        gdc_wait()
    offs = toks[:, None] * E + cols  # int32 (SPLIT*T*E < 2**31, checked)
    logits = tl.zeros([SEL_T, E], dtype=tl.float32)
    for k in tl.static_range(SPLIT):  # split order; all SPLIT loads in flight together
        logits += tl.load(part_ptr + k * T * E + offs, mask=m, other=0.0)
    scores = _sigmoid(logits, ON_GPU)
    c = scores + bias
    keep = _group_keep(tl.reshape(c, [SEL_T, NG, GS]), NG, TOPK_GROUP)
    keep_e = tl.reshape(tl.broadcast_to(keep[:, :, None], [SEL_T, NG, GS]), [SEL_T, E])
    key = tl.where(keep_e, _key(c, cols, E), _NEG_KEY)
    slot = tl.arange(0, TOP_K)[None, :]
    ids = tl.zeros([SEL_T, TOP_K], dtype=tl.int32)
    w = tl.zeros([SEL_T, TOP_K], dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # top_k by repeated arg-max, descending
        idx = E - 1 - tl.max(key, axis=1).to(tl.int32)  # the low word: E - 1 - expert
        hit = cols == idx[:, None]
        sj = tl.max(tl.where(hit, scores, float("-inf")), axis=1)
        key = tl.where(hit, _NEG_KEY, key)
        ids = tl.where(slot == j, idx[:, None], ids)
        w = tl.where(slot == j, sj[:, None], w)
    denom = _tree_sum(w, TOP_K) + 1e-20
    w = tl.div_rn(w, tl.broadcast_to(denom[:, None], [SEL_T, TOP_K]))
    out = toks.to(tl.int64)[:, None] * TOP_K + slot
    tl.store(w_out_ptr + out, w, mask=m)
    tl.store(id_out_ptr + out, ids.to(tl.int64), mask=m)


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check(h, weight, bias, n_group: int, topk_group: int, top_k: int) -> None:
    if h.dim() != 2 or weight.dim() != 2 or bias.dim() != 1 or weight.shape[1] != h.shape[1] \
            or bias.shape[0] != weight.shape[0]:
        raise ValueError(f"router expects h[T,H], weight[E,H], bias[E]; got h {tuple(h.shape)}, "
                         f"weight {tuple(weight.shape)}, bias {tuple(bias.shape)}")
    if h.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"router expects bf16 (or fp16/fp32) h; got {h.dtype}")
    if weight.dtype != torch.float32 or bias.dtype != torch.float32:
        raise ValueError(f"router expects an fp32 weight and bias; got {weight.dtype}, "
                         f"{bias.dtype} (the router is never run in BF16)")
    e = weight.shape[0]
    if not (_pow2(e) and _pow2(n_group) and e % n_group == 0 and 2 <= e // n_group <= 64):
        raise ValueError(f"router triton_v6 needs a power-of-2 expert count split into a power-"
                         f"of-2 number of groups of 2 to 64; got E={e}, n_group={n_group}")
    if not (1 <= topk_group <= n_group and _pow2(top_k) and top_k <= 32
            and top_k <= topk_group * (e // n_group)):
        raise ValueError(f"router triton_v6 needs 1 <= topk_group <= n_group and a power-of-2 "
                         f"top_k <= 32 within the kept groups; got topk_group={topk_group}, "
                         f"top_k={top_k}, n_group={n_group}, E={e}")
    if 40 * h.shape[0] * e >= 2**31:
        raise ValueError(f"router triton_v6 indexes its partial logits in int32; T={h.shape[0]} "
                         f"tokens x E={e} experts is too many: split the batch")
    if h.stride(1) != 1 or weight.stride(1) != 1 or bias.stride(0) != 1:
        raise ValueError(f"router needs unit stride along H and E; strides h {h.stride()}, weight "
                         f"{weight.stride()}, bias {bias.stride()}: pass .contiguous() tensors")
    if not h.device == weight.device == bias.device:
        raise ValueError(f"h on {h.device}, weight on {weight.device}, bias on {bias.device}")


def default_config(t: int) -> dict:
    """triton_v4's GEMV tiles up to 4 tokens; from 5 the three-term BF16 tiles (tokens x 32 or 64
    experts x 256-deep K slices to 64 tokens, 64 x 128 tiles in 4 K slices above), on a GPU and on
    the CPU alike; the top-k selection on 8 warps, one program a token, up to 64 tokens, the
    rounds (one warp a token) above; PDL on a GPU (`router_fwd` drops it elsewhere)."""
    base = {"GEMM": "fma", "BLOCK_T": 1, "BLOCK_E": 8, "BLOCK_K": 256, "SPLIT_K": 20,
            "num_warps": 1, "num_stages": 2, "SEL": "topk", "SEL_T": 1, "SEL_WARPS": 8,
            "PDL": 1}
    if t <= 1:  # 640 one-warp programs, each one 8 KB weight load issued at once
        return base
    if t <= 2:
        return {**base, "BLOCK_T": 2, "BLOCK_E": 4}
    if t <= 4:  # 640 two-warp programs of one 256-wide step
        return {**base, "BLOCK_T": 4, "num_warps": 2}
    if t <= 16:  # 16 x 32 tiles, 20 K slices of 128-deep steps: 160 programs
        return {**base, "GEMM": "bf16x3", "BLOCK_T": 16, "BLOCK_E": 32, "BLOCK_K": 128,
                "num_warps": 4}
    if t <= 32:  # 32 x 64 tiles, 20 K slices: 80 programs
        return {**base, "GEMM": "bf16x3", "BLOCK_T": 32, "BLOCK_E": 64, "BLOCK_K": 64,
                "num_warps": 4}
    if t <= 64:  # 8 expert tiles x 20 K slices: 160 programs, the weight read once
        return {**base, "GEMM": "bf16x3", "BLOCK_T": 64, "BLOCK_E": 32, "BLOCK_K": 64,
                "num_warps": 4}
    # 64 x 128 tiles, 4 K slices: 128 programs at T = 1024, 256 at 2048; h read twice (from L2)
    return {**base, "GEMM": "bf16x3", "BLOCK_T": 64, "BLOCK_E": 128, "BLOCK_K": 64, "SPLIT_K": 4,
            "num_warps": 4, "num_stages": 3, "SEL": "rounds", "SEL_WARPS": 1}


def router_fwd(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, n_group: int,
               topk_group: int, top_k: int, cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the GEMM (three-term BF16 tiles, FMA or dot tiles, or the library GEMM) and the
    selection."""
    _check(h, weight, bias, n_group, topk_group, top_k)
    t, hid = h.shape
    e = weight.shape[0]
    w_out = torch.empty((t, top_k), dtype=torch.float32, device=h.device)
    id_out = torch.empty((t, top_k), dtype=torch.int64, device=h.device)
    if t == 0:
        return w_out, id_out
    pdl = bool(cfg.get("PDL")) and h.is_cuda and gdc_wait is not None
    launch = {"launch_pdl": True} if pdl else {}
    gemm = cfg.get("GEMM", "fma")
    if gemm not in CONFIG_SPACE["GEMM"]:
        raise ValueError(f"router triton_v6: GEMM must be one of {CONFIG_SPACE['GEMM']}, "
                         f"got {gemm!r}")
    if gemm == "bf16x3" and h.dtype != torch.bfloat16:
        gemm = "dot"  # FP16/FP32 activations times a BF16 term: not exact on BF16 tensor cores
    if gemm == "lib":
        # The reference's GEMM call (FP32 cuBLAS on the GPU; TF32 off unless the caller set it).
        part, split = F.linear(h.float(), weight).contiguous(), 1
    else:
        block_t, block_k = int(cfg["BLOCK_T"]), int(cfg["BLOCK_K"])
        block_e = min(int(cfg["BLOCK_E"]), e)
        if gemm in ("dot", "bf16x3"):  # tl.dot tiles are at least 16 on every side
            block_t, block_e, block_k = max(16, block_t), max(16, block_e), max(16, block_k)
        split = max(1, min(int(cfg["SPLIT_K"]), triton.cdiv(hid, block_k)))
        k_steps = triton.cdiv(triton.cdiv(hid, split), block_k)
        split = triton.cdiv(hid, k_steps * block_k)  # no empty K slice
        part = torch.empty((split, t, e), dtype=torch.float32, device=h.device)
        grid = (triton.cdiv(e, block_e), split, triton.cdiv(t, block_t))
        common = dict(E=e, BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k, K_STEPS=k_steps,
                      PDL=pdl, num_warps=int(cfg["num_warps"]), **launch)
        if gemm == "bf16x3":
            _router_bf16x3_kernel[grid](h, weight, part, t, hid, h.stride(0), weight.stride(0),
                                        ON_GPU=h.is_cuda, num_stages=int(cfg["num_stages"]),
                                        **common)
        else:
            kernel = _router_dot_kernel if gemm == "dot" else _router_gemv_kernel
            kernel[grid](h, weight, part, t, hid, h.stride(0), weight.stride(0),
                         H_BF16=h.dtype == torch.bfloat16, **common)
    sel_pdl = pdl and gemm != "lib"
    meta = dict(SPLIT=split, E=e, NG=n_group, TOPK_GROUP=topk_group, TOP_K=top_k,
                ON_GPU=h.is_cuda, PDL=sel_pdl, num_warps=int(cfg["SEL_WARPS"]),
                **(launch if sel_pdl else {}))
    if cfg.get("SEL", "topk") == "rounds":
        sel_t = min(int(cfg.get("SEL_T", 1)), triton.next_power_of_2(t))
        _router_select_rounds_kernel[(triton.cdiv(t, sel_t),)](
            part, bias, w_out, id_out, t, SEL_T=sel_t, **meta)
    else:
        _router_select_topk_kernel[(t,)](part, bias, w_out, id_out, t, **meta)
    return w_out, id_out


def run(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, n_group: int,
        topk_group: int, top_k: int, config: dict | None = None):
    """router(h[T,H] bf16, weight[E,H] fp32, bias[E] fp32, n_group, topk_group, top_k)
    -> (weights[T,k] fp32, ids[T,k] int64)."""
    cfg = {**default_config(h.shape[0] if h.dim() == 2 else 1), **DEFAULT_CONFIG, **(config or {})}
    return router_fwd(h, weight, bias, int(n_group), int(topk_group), int(top_k), cfg)
