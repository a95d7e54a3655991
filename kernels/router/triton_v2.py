"""router triton_v2 (hand-written): whole-expert GEMV programs, a ranking selection in the last.

triton_v1 at T = 1 on an H200 spends ~4 of its 7.8 us after the weight read: its last program
sums 20 split-K partials per expert, runs the sigmoid, then takes the top-8 in eight serial
rounds of a 256-wide 64-bit max on one warp. Here:
  - each GEMV program owns BLOCK_E whole experts (all of K, so no partials) and writes their
    s = sigmoid(logit) and c = s + bias: the tail starts from 2 x E finished values;
  - the tail ranks instead of taking maxima one after another: every value of a group is compared
    with every other of it at once ([n_group, group size, group size]), which gives both the
    group's top-2 sum and its candidates in order; the kept groups' candidates (top_k per group,
    or the whole group if smaller) are ranked the same way for the top-k. No serial rounds.
The order is the reference's: c descending, equal values lower expert first (torch.topk's choice
among FP32 ties is the op's tolerated difference); groups likewise, the lower group first.

Formula (the router contract, model/ops/router.py):
    logits = f32(h) @ W^T              FP32 products and sums (no TF32)
    s      = 1 / (1 + expf(-logits))   IEEE divide (`div_rn`), libdevice expf on the GPU
    c      = s + bias                  selection only
    group score = sum of the top-2 of c in each of n_group groups; keep the top topk_group groups
    ids    = top_k of c over the kept groups, sorted descending
    w      = s[ids] / (sum(s[ids]) + 1e-20), the sum in torch's CUDA order for 8 values,
             ((w0+w4)+(w2+w6))+((w1+w5)+(w3+w7)) (a halving tree), IEEE divide.
Rounding: FP32 throughout. The GEMV sums K in its own order (per lane across BLOCK_K steps, then
across lanes), not cuBLAS's: logits differ by a few FP32 ulps, within the op's policy. A group's
top-2 sum adds its two largest values (zeros elsewhere: exact), as torch adds two.

Kernels:
  decode (T <= FUSE_MAX_T, config FUSE): one. Programs over (expert blocks, token blocks)
          compute s and c into a scratch [2, T, E]; the last program of a token block to finish
          (a device counter per token block: an acq_rel atomic per program, re-armed by the last)
          selects for that block's tokens, one token at a time.
  others: the same GEMV without the tail (the FMA tiles), or from 9 tokens on a GPU (LIB_GEMM)
          the reference's own FP32 cuBLAS GEMM for the logits (bitwise the reference's); then one
          selection program per token.
Memory traffic: read 4*E*H (weight) + 2*T*H + 4*E; s and c 2 * 8*T*E (L2); write 12*T*top_k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

LANGUAGE = "triton"
# Meta-parameters only: every config computes the same selection on FP32 logits whose
# summation order depends on BLOCK_K/num_warps/LIB_GEMM (within the policy).
CONFIG_SPACE = {
    "BLOCK_E": [1, 2, 4, 8, 16, 32],
    "BLOCK_K": [64, 128, 256, 512, 1024, 2048],
    "BLOCK_T": [1, 2, 4, 8, 16],
    "FUSE": [0, 1],
    "num_warps": [1, 2, 4, 8],
    "SEL_WARPS": [1, 2, 4, 8],
    "LIB_GEMM": [0, 1],
}
# Unset keys follow `default_config(T)`.
DEFAULT_CONFIG: dict = {}
FUSE_MAX_T = 8  # the fused tail selects token after token: decode only
UNROLL_MAX = tl.constexpr(8)  # K ranges of up to this many BLOCK_K steps are unrolled
# Above this many tokens the reference's cuBLAS logits are used whatever the config says (the
# FMA tiles are slower there, and the library's logits are the reference's bit for bit).
FMA_TILES_MAX_T = 64
_COUNTERS: dict[tuple[str, int | None], torch.Tensor] = {}


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
    # One level of the renorm tree on [N]: v[i] + v[i + N/2] for i < N/2.
    lo, hi = tl.split(tl.permute(tl.reshape(v, [2, N // 2]), [1, 0]))
    return lo + hi


@triton.jit
def _tree_sum(v, K: tl.constexpr):
    # torch's CUDA order over 8 values, ((w0+w4)+(w2+w6))+((w1+w5)+(w3+w7)), for any power of 2.
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
    return tl.sum(v, axis=0)  # one element left


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
    denom = _tree_sum(sw, TOP_K) + 1e-20
    return ids, tl.div_rn(sw, tl.full([TOP_K], 0.0, tl.float32) + denom)


@triton.jit
def _store_token(w_out_ptr, id_out_ptr, tok, ids, w, TOP_K: tl.constexpr):
    out = tok.to(tl.int64) * TOP_K + tl.arange(0, TOP_K)
    tl.store(w_out_ptr + out, w)
    tl.store(id_out_ptr + out, ids.to(tl.int64))


@triton.jit
def _router_gemv_kernel(h_ptr, w_ptr, sc_ptr, bias_ptr, w_out_ptr, id_out_ptr, count_ptr,
                        T, H, stride_h, stride_w,
                        E: tl.constexpr, NG: tl.constexpr, TOPK_GROUP: tl.constexpr,
                        TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                        BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr, H_BF16: tl.constexpr,
                        FUSE: tl.constexpr, ON_GPU: tl.constexpr):
    pe, pt = tl.program_id(0), tl.program_id(1)
    toks = pt * BLOCK_T + tl.arange(0, BLOCK_T)
    exps = pe * BLOCK_E + tl.arange(0, BLOCK_E)
    h_rows = h_ptr + toks.to(tl.int64)[:, None, None] * stride_h
    w_rows = w_ptr + exps.to(tl.int64)[None, :, None] * stride_w
    tmask = (toks < T)[:, None, None]
    # Products summed per lane over the K steps, across lanes once at the end.
    acc = tl.zeros([BLOCK_T, BLOCK_E, BLOCK_K], dtype=tl.float32)
    if K_STEPS <= UNROLL_MAX:  # every weight load of the program issued at once
        for i in tl.static_range(K_STEPS):
            ks = i * BLOCK_K + tl.arange(0, BLOCK_K)[None, None, :]
            x = tl.load(h_rows + ks, mask=tmask & (ks < H), other=0.0)
            x = _bf16_to_f32(x) if H_BF16 else x.to(tl.float32)
            acc += x * tl.load(w_rows + ks, mask=ks < H, other=0.0)
    else:
        for i in range(K_STEPS):
            ks = i * BLOCK_K + tl.arange(0, BLOCK_K)[None, None, :]
            x = tl.load(h_rows + ks, mask=tmask & (ks < H), other=0.0)
            x = _bf16_to_f32(x) if H_BF16 else x.to(tl.float32)
            acc += x * tl.load(w_rows + ks, mask=ks < H, other=0.0)
    s = _sigmoid(tl.sum(acc, axis=2), ON_GPU)
    c = s + tl.load(bias_ptr + exps)[None, :]
    offs = toks.to(tl.int64)[:, None] * E + exps[None, :]
    m = (toks < T)[:, None]
    tl.store(sc_ptr + offs, s, mask=m)
    tl.store(sc_ptr + T * E + offs, c, mask=m)
    if FUSE:
        # The last program of this token block selects for its tokens. The barrier orders all
        # threads' stores before the (acq_rel, gpu-scope) increment that publishes them.
        tl.debug_barrier()
        done = tl.atomic_add(count_ptr + pt, 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(0) - 1:
            tl.debug_barrier()
            GS: tl.constexpr = E // NG
            ex = tl.arange(0, NG)[:, None] * GS + tl.arange(0, GS)[None, :]
            for j in range(BLOCK_T):
                tok = pt * BLOCK_T + j
                if tok < T:
                    row = tok.to(tl.int64) * E + ex
                    ss = tl.load(sc_ptr + row, cache_modifier=".cg")
                    cc = tl.load(sc_ptr + T * E + row, cache_modifier=".cg")
                    ids, w = _select_values(cc, ss, E, NG, TOPK_GROUP, TOP_K)
                    _store_token(w_out_ptr, id_out_ptr, tok, ids, w, TOP_K)
            tl.atomic_xchg(count_ptr + pt, 0, sem="relaxed", scope="gpu")  # for the next call


@triton.jit
def _router_select_kernel(sc_ptr, bias_ptr, w_out_ptr, id_out_ptr, T, E: tl.constexpr,
                          NG: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                          FROM_LOGITS: tl.constexpr, ON_GPU: tl.constexpr):
    tok = tl.program_id(0)
    GS: tl.constexpr = E // NG
    ex = tl.arange(0, NG)[:, None] * GS + tl.arange(0, GS)[None, :]
    row = tok.to(tl.int64) * E + ex
    if FROM_LOGITS:  # sc holds the logits [T, E]
        s = _sigmoid(tl.load(sc_ptr + row), ON_GPU)
        c = s + tl.load(bias_ptr + ex)
    else:  # sc holds s then c, [2, T, E]
        s = tl.load(sc_ptr + row)
        c = tl.load(sc_ptr + T * E + row)
    ids, w = _select_values(c, s, E, NG, TOPK_GROUP, TOP_K)
    _store_token(w_out_ptr, id_out_ptr, tok, ids, w, TOP_K)


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
        raise ValueError(f"router triton_v2 needs a power-of-2 expert count split into a power-"
                         f"of-2 number of groups of 2 to 64; got E={e}, n_group={n_group}")
    if not (1 <= topk_group <= n_group and _pow2(top_k) and top_k <= 32
            and top_k <= topk_group * (e // n_group)):
        raise ValueError(f"router triton_v2 needs 1 <= topk_group <= n_group and a power-of-2 "
                         f"top_k <= 32 within the kept groups; got topk_group={topk_group}, "
                         f"top_k={top_k}, n_group={n_group}, E={e}")
    if h.stride(1) != 1 or weight.stride(1) != 1 or bias.stride(0) != 1:
        raise ValueError(f"router needs unit stride along H and E; strides h {h.stride()}, weight "
                         f"{weight.stride()}, bias {bias.stride()}: pass .contiguous() tensors")
    if not h.device == weight.device == bias.device:
        raise ValueError(f"h on {h.device}, weight on {weight.device}, bias on {bias.device}")


def default_config(t: int, on_gpu: bool = True) -> dict:
    """Decode: one fused kernel up to FUSE_MAX_T tokens; from 9 tokens on a GPU the reference's
    cuBLAS GEMM, then the selection kernel. The CPU (interpreter) keeps the FMA tiles up to 64
    tokens: speed does not matter there, and they are the Triton path to judge."""
    base = {"BLOCK_E": 2, "BLOCK_K": 1024, "BLOCK_T": 1, "FUSE": 1, "num_warps": 4,
            "SEL_WARPS": 4, "LIB_GEMM": 0}
    if t <= 1:  # 128 programs of two whole experts (40 KB each, all loads in flight)
        return base
    if t <= FUSE_MAX_T:  # token pairs: the weight comes from L2 for all but the first pair
        return {**base, "BLOCK_T": 2, "BLOCK_K": 512}
    if t <= FMA_TILES_MAX_T and not on_gpu:
        return {**base, "BLOCK_T": 16, "BLOCK_E": 8, "BLOCK_K": 64, "FUSE": 0}
    return {**base, "FUSE": 0, "LIB_GEMM": 1}


def _counter(device: torch.device) -> torch.Tensor:
    key = (device.type, device.index)
    if key not in _COUNTERS:  # zeroed once; the last program of each token block re-zeroes it
        _COUNTERS[key] = torch.zeros(FUSE_MAX_T, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def router_fwd(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, n_group: int,
               topk_group: int, top_k: int, cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the GEMV (and, unless fused, the selection) with an explicit config."""
    _check(h, weight, bias, n_group, topk_group, top_k)
    t, hid = h.shape
    e = weight.shape[0]
    w_out = torch.empty((t, top_k), dtype=torch.float32, device=h.device)
    id_out = torch.empty((t, top_k), dtype=torch.int64, device=h.device)
    if t == 0:
        return w_out, id_out
    meta = dict(E=e, NG=n_group, TOPK_GROUP=topk_group, TOP_K=top_k, ON_GPU=h.is_cuda)
    if int(cfg.get("LIB_GEMM", 0)) or t > FMA_TILES_MAX_T:
        # The reference's GEMM call (FP32 cuBLAS on the GPU; TF32 off unless the caller set it).
        logits = F.linear(h.float(), weight).contiguous()
        _router_select_kernel[(t,)](logits, bias, w_out, id_out, t, FROM_LOGITS=True,
                                    num_warps=int(cfg["SEL_WARPS"]), **meta)
        return w_out, id_out
    block_t, block_e = int(cfg["BLOCK_T"]), min(int(cfg["BLOCK_E"]), e)
    block_k = min(int(cfg["BLOCK_K"]), triton.next_power_of_2(hid))
    blocks_t = triton.cdiv(t, block_t)
    fuse = bool(cfg["FUSE"]) and t <= FUSE_MAX_T and blocks_t <= FUSE_MAX_T
    sc = torch.empty((2, t, e), dtype=torch.float32, device=h.device)
    counter = _counter(h.device) if fuse else sc
    _router_gemv_kernel[(e // block_e, blocks_t)](
        h, weight, sc, bias, w_out, id_out, counter, t, hid, h.stride(0), weight.stride(0),
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k, K_STEPS=triton.cdiv(hid, block_k),
        H_BF16=h.dtype == torch.bfloat16, FUSE=fuse, num_warps=int(cfg["num_warps"]), **meta,
    )
    if not fuse:
        _router_select_kernel[(t,)](sc, bias, w_out, id_out, t, FROM_LOGITS=False,
                                    num_warps=int(cfg["SEL_WARPS"]), **meta)
    return w_out, id_out


def run(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, n_group: int,
        topk_group: int, top_k: int, config: dict | None = None):
    """router(h[T,H] bf16, weight[E,H] fp32, bias[E] fp32, n_group, topk_group, top_k)
    -> (weights[T,k] fp32, ids[T,k] int64)."""
    cfg = {**default_config(h.shape[0] if h.dim() == 2 else 1, h.is_cuda), **DEFAULT_CONFIG,
           **(config or {})}
    return router_fwd(h, weight, bias, int(n_group), int(topk_group), int(top_k), cfg)
