"""router triton_v3 (hand-written): triton_v1's split-K GEMV, a ranking selection, both under PDL.

triton_v1 at T = 1 takes ~8 us on an H200 where one plain read of the 5.2 MB weight takes 3.8: its
last GEMV program waits on a device counter, then sums the partials and takes the top-8 in eight
serial rounds of a 256-wide 64-bit max on one warp. triton_v2 ranked instead of iterating, but
behind whole-expert GEMV programs that read the weight more slowly. Here:
  - the GEMV is triton_v1's (experts x K splits x token blocks, FP32 FMAs, partials in L2), so
    the weight streams as fast as there; with PDL (a programmatic dependent launch, sm_90) each
    program issues its weight loads before it waits for the previous kernel's output (the
    weight does not depend on it; the hidden state does), so the stream starts while the
    previous kernel drains;
  - no counter and no last program: a second kernel, one program per token, launched as a
    programmatic dependent of the GEMV (its programs wait on the GEMV grid with
    griddepcontrol.wait instead of a launch gap), sums the partials in split order and ranks
    as triton_v2 does: every value of a group against every other ([groups, size, size] at
    once) for the group's top-2 sum and its candidates in order; the kept groups' candidates
    ranked the same way for the top-k. No serial rounds. From 17 tokens (config SEL) the
    selection is triton_v1's rounds instead, cheaper per token where throughput counts.
The order is the reference's: c descending, equal values lower expert first; groups likewise.

Formula (the router contract, model/ops/router.py):
    logits = f32(h) @ W^T              FP32 products and sums (no TF32)
    s      = 1 / (1 + expf(-logits))   IEEE divide (`div_rn`), libdevice expf on the GPU
    c      = s + bias                  selection only
    group score = sum of the top-2 of c in each of n_group groups; keep the top topk_group groups
    ids    = top_k of c over the kept groups, sorted descending
    w      = s[ids] / (sum(s[ids]) + 1e-20), the sum in torch's CUDA order for 8 values,
             ((w0+w4)+(w2+w6))+((w1+w5)+(w3+w7)) (a halving tree), IEEE divide.
Rounding: FP32 throughout. The GEMV's order is triton_v1's (split-K partials added in split
order), not cuBLAS's: logits differ by a few FP32 ulps, within the op's policy. With the same
GEMV config the logits, and so the outputs, are bitwise triton_v1's (its two-kernel path). From
9 tokens on a GPU (LIB_GEMM) the logits are the reference's own FP32 cuBLAS GEMM.
Memory traffic: read 4*E*H (weight) + 2*T*H + 4*E; partials 2 * 4*SPLIT_K*T*E (L2); write
12*T*top_k.
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
# summation order depends on SPLIT_K/BLOCK_K/LIB_GEMM (within the policy), never on warps or PDL.
CONFIG_SPACE = {
    "BLOCK_E": [2, 4, 8, 16, 32],
    "BLOCK_K": [32, 64, 128, 256, 512],
    "SPLIT_K": [1, 2, 4, 5, 10, 20, 40],
    "BLOCK_T": [1, 2, 4, 8, 16],
    "num_warps": [1, 2, 4, 8],
    "SEL": ["rank", "rounds"],
    "SEL_T": [1, 2, 4, 8],
    "SEL_WARPS": [1, 2, 4, 8, 16],
    "LIB_GEMM": [0, 1],
    "PDL": [0, 1],
}
# Unset keys follow `default_config(T)`.
DEFAULT_CONFIG: dict = {}
# Above this many tokens the reference's cuBLAS logits are used whatever the config says (the FMA
# tiles are slower there, and the library's logits are the reference's bit for bit).
FMA_TILES_MAX_T = 64
_NEG_KEY = tl.constexpr(-(2**62))  # below every real key (their top word is >= -2**31)


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
def _before(cj, ej, ci, ei):
    # j comes before i in the reference's order: the larger value, then the lower index.
    return (cj > ci) | ((cj == ci) & (ej < ei))


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
def _select_values(c, s, E: tl.constexpr, NG: tl.constexpr, TOPK_GROUP: tl.constexpr,
                   TOP_K: tl.constexpr):
    """c and s of one token as [NG, GS] -> (ids [TOP_K] int32, normalised weights [TOP_K])."""
    GS: tl.constexpr = E // NG
    CAND: tl.constexpr = TOP_K if TOP_K < GS else GS
    N2: tl.constexpr = NG * CAND
    ex = tl.arange(0, NG)[:, None] * GS + tl.arange(0, GS)[None, :]
    # Each expert's place in its group: how many of the group come before it (0 = largest).
    rank = tl.sum(_before(c[:, None, :], ex[:, None, :], c[:, :, None], ex[:, :, None])
                  .to(tl.int32), axis=2)
    gsc = tl.sum(tl.where(rank < 2, c, 0.0), axis=1)  # the group's top-2 sum
    ga = tl.arange(0, NG)
    g_place = tl.sum(_before(gsc[None, :], ga[None, :], gsc[:, None], ga[:, None])
                     .to(tl.int32), axis=1)
    keep = g_place < TOPK_GROUP
    # Each group's first CAND experts in order, then ranked among the kept groups'.
    hit = rank[:, None, :] == tl.arange(0, CAND)[None, :, None]  # [NG, CAND, GS]
    cc = tl.reshape(tl.max(tl.where(hit, c[:, None, :], float("-inf")), axis=2), [N2])
    cs = tl.reshape(tl.max(tl.where(hit, s[:, None, :], float("-inf")), axis=2), [N2])
    ce = tl.reshape(tl.max(tl.where(hit, ex[:, None, :], -1), axis=2), [N2])
    valid = tl.reshape(tl.broadcast_to(keep[:, None], [NG, CAND]), [N2])
    first = _before(cc[None, :], ce[None, :], cc[:, None], ce[:, None])
    ahead = valid[None, :] & ((valid[:, None] == 0) | first)
    place = tl.sum(ahead.to(tl.int32), axis=1)  # [N2]; the valid ones are 0 .. n_valid - 1
    pick = (place[None, :] == tl.arange(0, TOP_K)[:, None]) & valid[None, :]  # [TOP_K, N2]
    ids = tl.max(tl.where(pick, ce[None, :], -1), axis=1)
    sw = tl.max(tl.where(pick, cs[None, :], float("-inf")), axis=1)
    denom = _tree_sum(tl.reshape(sw, [1, TOP_K]), TOP_K) + 1e-20  # [1]
    return ids, tl.div_rn(sw, tl.full([TOP_K], 0.0, tl.float32) + denom)


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
def _router_select_kernel(part_ptr, bias_ptr, w_out_ptr, id_out_ptr, T, SPLIT: tl.constexpr,
                          E: tl.constexpr, NG: tl.constexpr, TOPK_GROUP: tl.constexpr,
                          TOP_K: tl.constexpr, ON_GPU: tl.constexpr, PDL: tl.constexpr):
    tok = tl.program_id(0)
    GS: tl.constexpr = E // NG
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
    ids, w = _select_values(s + bias, s, E, NG, TOPK_GROUP, TOP_K)
    out = tok.to(tl.int64) * TOP_K + tl.arange(0, TOP_K)
    tl.store(w_out_ptr + out, w)
    tl.store(id_out_ptr + out, ids.to(tl.int64))


# --- the selection by rounds (triton_v1's): less work per token, for many tokens --------------

@triton.jit
def _key(c, cols, E: tl.constexpr):
    # One int64 per expert ordering by c (monotonic image of the FP32 bits), then lower id first:
    # a single max reduction yields both the value and the expert.
    b = c.to(tl.int32, bitcast=True)
    mono = tl.where(b >= 0, b, b ^ 0x7FFFFFFF)
    return (mono.to(tl.int64) << 32) | (E - 1 - cols).to(tl.int64)


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
        raise ValueError(f"router triton_v3 needs a power-of-2 expert count split into a power-"
                         f"of-2 number of groups of 2 to 64; got E={e}, n_group={n_group}")
    if not (1 <= topk_group <= n_group and _pow2(top_k) and top_k <= 32
            and top_k <= topk_group * (e // n_group)):
        raise ValueError(f"router triton_v3 needs 1 <= topk_group <= n_group and a power-of-2 "
                         f"top_k <= 32 within the kept groups; got topk_group={topk_group}, "
                         f"top_k={top_k}, n_group={n_group}, E={e}")
    if 40 * h.shape[0] * e >= 2**31:
        raise ValueError(f"router triton_v3 indexes its partial logits in int32; T={h.shape[0]} "
                         f"tokens x E={e} experts is too many: split the batch")
    if h.stride(1) != 1 or weight.stride(1) != 1 or bias.stride(0) != 1:
        raise ValueError(f"router needs unit stride along H and E; strides h {h.stride()}, weight "
                         f"{weight.stride()}, bias {bias.stride()}: pass .contiguous() tensors")
    if not h.device == weight.device == bias.device:
        raise ValueError(f"h on {h.device}, weight on {weight.device}, bias on {bias.device}")


def default_config(t: int, on_gpu: bool = True) -> dict:
    """triton_v1's GEMV tiles per bucket (the fastest of its H200 sweeps), a 4-warp ranking
    program per token, PDL on the GPU. From 17 tokens on a GPU the reference's cuBLAS GEMM and
    triton_v1's selection by rounds, one one-warp program per token: with many tokens the
    ranking's extra work per token costs more than its shorter chain saves (an H100: 180 us
    against 157 at T = 2048, 0.6 us more at 32 and 64)."""
    base = {"BLOCK_T": 1, "BLOCK_E": 8, "BLOCK_K": 256, "SPLIT_K": 20, "num_warps": 1,
            "SEL": "rank", "SEL_T": 1, "SEL_WARPS": 4, "LIB_GEMM": 0, "PDL": 1}
    if t <= 1:  # 640 one-warp programs, each one 8 KB weight load issued at once
        return base
    if t <= 2:
        return {**base, "BLOCK_T": 2, "BLOCK_E": 4}
    if t <= 4:  # 640 two-warp programs of one 256-wide step
        return {**base, "BLOCK_T": 4, "num_warps": 2}
    if t <= 16 or (t <= FMA_TILES_MAX_T and not on_gpu):  # 1280 programs of 4 experts
        return {**base, "BLOCK_T": min(16, triton.next_power_of_2(t)), "BLOCK_E": 4,
                "BLOCK_K": 128, "num_warps": 2}
    # From 17 tokens an FP32 GEMM through cuBLAS (the reference's own call, so its logits are
    # bitwise the reference's) beats CUDA-core FMAs in Triton (triton_v1's sweeps at 32 and 64).
    return {**base, "LIB_GEMM": 1, "SEL": "rounds", "SEL_WARPS": 1}


def router_fwd(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, n_group: int,
               topk_group: int, top_k: int, cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the GEMV (or the library GEMM) and the selection with an explicit config."""
    _check(h, weight, bias, n_group, topk_group, top_k)
    t, hid = h.shape
    e = weight.shape[0]
    w_out = torch.empty((t, top_k), dtype=torch.float32, device=h.device)
    id_out = torch.empty((t, top_k), dtype=torch.int64, device=h.device)
    if t == 0:
        return w_out, id_out
    pdl = bool(cfg.get("PDL")) and h.is_cuda and gdc_wait is not None
    launch = {"launch_pdl": True} if pdl else {}
    lib = bool(int(cfg.get("LIB_GEMM", 0))) or t > FMA_TILES_MAX_T
    if lib:
        # The reference's GEMM call (FP32 cuBLAS on the GPU; TF32 off unless the caller set it).
        part, split = F.linear(h.float(), weight).contiguous(), 1
    else:
        block_t, block_k = int(cfg["BLOCK_T"]), int(cfg["BLOCK_K"])
        block_e = min(int(cfg["BLOCK_E"]), e)
        split = max(1, min(int(cfg["SPLIT_K"]), triton.cdiv(hid, block_k)))
        k_steps = triton.cdiv(triton.cdiv(hid, split), block_k)
        split = triton.cdiv(hid, k_steps * block_k)  # no empty K slice
        part = torch.empty((split, t, e), dtype=torch.float32, device=h.device)
        _router_gemv_kernel[(e // block_e, split, triton.cdiv(t, block_t))](
            h, weight, part, t, hid, h.stride(0), weight.stride(0), E=e, BLOCK_T=block_t,
            BLOCK_E=block_e, BLOCK_K=block_k, K_STEPS=k_steps,
            H_BF16=h.dtype == torch.bfloat16, PDL=pdl, num_warps=int(cfg["num_warps"]), **launch)
    sel_pdl = pdl and not lib
    meta = dict(SPLIT=split, E=e, NG=n_group, TOPK_GROUP=topk_group, TOP_K=top_k,
                ON_GPU=h.is_cuda, PDL=sel_pdl, num_warps=int(cfg["SEL_WARPS"]),
                **(launch if sel_pdl else {}))
    if cfg.get("SEL", "rank") == "rounds":
        sel_t = min(int(cfg.get("SEL_T", 1)), triton.next_power_of_2(t))
        _router_select_rounds_kernel[(triton.cdiv(t, sel_t),)](
            part, bias, w_out, id_out, t, SEL_T=sel_t, **meta)
    else:
        _router_select_kernel[(t,)](part, bias, w_out, id_out, t, **meta)
    return w_out, id_out


def run(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, n_group: int,
        topk_group: int, top_k: int, config: dict | None = None):
    """router(h[T,H] bf16, weight[E,H] fp32, bias[E] fp32, n_group, topk_group, top_k)
    -> (weights[T,k] fp32, ids[T,k] int64)."""
    cfg = {**default_config(h.shape[0] if h.dim() == 2 else 1, h.is_cuda), **DEFAULT_CONFIG,
           **(config or {})}
    return router_fwd(h, weight, bias, int(n_group), int(topk_group), int(top_k), cfg)
