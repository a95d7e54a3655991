"""router: FP32 split GEMV + sigmoid, grouped top-k and renorm in one (fused) or two kernels.

# {{HEADER}}

Formula (the router contract): logits = f32(h) @ W^T (FP32, no TF32); s = 1/(1+expf(-logits))
(IEEE divide, libdevice expf on the GPU); c = s + bias for selection only; group score = top-2 sum
of c per group; keep topk_group groups; ids = top_k of c there, descending (ties: lower expert);
w = s[ids] / (sum + 1e-20), the sum in torch's CUDA order ((w0+w4)+(w2+w6))+((w1+w5)+(w3+w7)).
Tuned per token bucket: how the 5.2 MB FP32 weight is split over the SMs (BLOCK_E experts x
SPLIT_K slices of H, BLOCK_K per step, BLOCK_T tokens per program; FP32 FMAs), whether the last
GEMV program selects for every token (FUSE: one kernel, decode) or a second kernel does (SEL_T
tokens per program), the warps of each, and where the logits come from instead: the reference's
own cuBLAS GEMM (LIB_GEMM, bitwise the reference's logits), or BF16 tensor cores (TC_GEMM, tiles
of TC_BLOCK_T tokens x TC_BLOCK_E experts: each FP32 weight tile split in registers into three
BF16 terms that sum to it exactly; with BF16 h every product is exact in FP32, and each K step's
tensor-core sum is added to the total in FP32 on the CUDA cores, so only the summation order
differs; never TF32, which rounds the weight). The split changes the GEMM's FP32 summation order
only, which the op's policy allows (a few FP32 ulps); the selection (in registers) and the
renorm are the same in every config.
Memory traffic: read 4*E*H + 2*T*H + 4*E; FP32 partials 8*SPLIT_K*T*E (L2); write 12*T*top_k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

# Meta-parameters only: every config computes the same selection on FP32 logits whose
# summation order depends on SPLIT_K/BLOCK_K/LIB_GEMM/TC_GEMM (within the policy), never on
# warps. The TC_GEMM tiles have their own sizes (tl.dot's are at least 16 a side).
CONFIG_SPACE = {
    "BLOCK_E": [2, 4, 8, 16, 32],
    "BLOCK_K": [32, 64, 128, 256, 512],
    "SPLIT_K": [1, 2, 4, 5, 10, 20, 40],
    "BLOCK_T": [1, 2, 4, 8, 16],
    "FUSE": [0, 1],
    "SEL_T": [1, 2, 4, 8],
    "num_warps": [1, 2, 4, 8],
    "SEL_WARPS": [1, 2, 4, 8],
    "LIB_GEMM": [0, 1],
    "TC_GEMM": [0, 1],
    "TC_BLOCK_T": [16, 32, 64],
    "TC_BLOCK_E": [16, 32, 64, 128],
}
# Empty: each token bucket keeps `default_config(T)` until the tuner sets its keys.
DEFAULT_CONFIG: dict = {}
_FUSE_MAX_T = 8  # the fused tail selects every token in one program: decode only
_COUNTERS: dict[tuple[str, int | None], torch.Tensor] = {}
_NEG_KEY = tl.constexpr(-(2**63))  # below every real key: a finite value's top word is > -2**31


# {{common.bf16_to_f32}}: _bf16_to_f32


# {{common.exp}}: _exp


@triton.jit
def _halve(v, N: tl.constexpr):
    # One level of the renorm tree on [rows, N]: v[:, i] + v[:, i + N/2] for i < N/2.
    lo, hi = tl.split(tl.permute(tl.reshape(v, [v.shape[0], 2, N // 2]), [0, 2, 1]))
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
    return tl.reshape(v, [v.shape[0]])


@triton.jit
def _key(c, cols, E: tl.constexpr):
    # One int64 per expert ordering by c (monotonic image of the FP32 bits), then lower id first:
    # a single max reduction yields both the value and the expert.
    b = c.to(tl.int32, bitcast=True)
    mono = tl.where(b >= 0, b, b ^ 0x7FFFFFFF)
    return (mono.to(tl.int64) << 32) | (E - 1 - cols).to(tl.int64)


@triton.jit
def _group_keep(c3, NG: tl.constexpr, TOPK_GROUP: tl.constexpr):
    # Group score = the top-2 of c summed; a repeated maximum counts twice (torch.topk's values):
    # the max, then a masked max and a count of the maximum (independent of each other).
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
def _route_tokens(part_ptr, bias_ptr, w_out_ptr, id_out_ptr, t0, T, SPLIT: tl.constexpr,
                  E: tl.constexpr, NG: tl.constexpr, TOPK_GROUP: tl.constexpr,
                  TOP_K: tl.constexpr, SEL_T: tl.constexpr, ON_GPU: tl.constexpr):
    # Everything stays in registers (no store-and-gather): rows of E for the top-k rounds, viewed
    # as [SEL_T, NG, GS] for the group stage only.
    GS: tl.constexpr = E // NG
    toks = t0 + tl.arange(0, SEL_T)
    cols = tl.arange(0, E)[None, :]
    m = (toks < T)[:, None]
    offs = toks[:, None] * E + cols  # int32 (SPLIT*T*E < 2**31, checked): 16-byte loads
    logits = tl.zeros([SEL_T, E], dtype=tl.float32)
    # Partial sums added in split order; unrolled so all SPLIT loads (L2: written by other SMs)
    # are in flight together instead of one round trip per split.
    for s in tl.static_range(SPLIT):
        logits += tl.load(part_ptr + s * T * E + offs, mask=m, other=0.0, cache_modifier=".cg")
    scores = tl.div_rn(tl.full([SEL_T, E], 1.0, tl.float32), 1.0 + _exp(-logits, ON_GPU))
    c = scores + tl.load(bias_ptr + cols)
    keep = _group_keep(tl.reshape(c, [SEL_T, NG, GS]), NG, TOPK_GROUP)
    keep_e = tl.reshape(tl.broadcast_to(keep[:, :, None], [SEL_T, NG, GS]), [SEL_T, E])
    key = tl.where(keep_e, _key(c, cols, E), _NEG_KEY)
    slot = tl.arange(0, TOP_K)[None, :]
    ids = tl.zeros([SEL_T, TOP_K], dtype=tl.int32)
    w = tl.zeros([SEL_T, TOP_K], dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # top_k by repeated arg-max, descending
        idx = E - 1 - tl.max(key, axis=1).to(tl.int32)  # the low word: E - 1 - expert
        hit = cols == idx[:, None]
        # The winner's score: off the next round's critical path (only `key` feeds it).
        sj = tl.max(tl.where(hit, scores, float("-inf")), axis=1)
        key = tl.where(hit, _NEG_KEY, key)
        ids = tl.where(slot == j, idx[:, None], ids)
        w = tl.where(slot == j, sj[:, None], w)
    denom = _tree_sum(w, TOP_K) + 1e-20
    w = tl.div_rn(w, tl.broadcast_to(denom[:, None], [SEL_T, TOP_K]))
    out = toks.to(tl.int64)[:, None] * TOP_K + slot
    tl.store(w_out_ptr + out, w, mask=m)
    tl.store(id_out_ptr + out, ids.to(tl.int64), mask=m)


@triton.jit
def _gemv_step(h_rows, w_rows, tmask, k0, H, acc, BLOCK_K: tl.constexpr, H_BF16: tl.constexpr):
    ks = k0 + tl.arange(0, BLOCK_K)
    km = (ks < H)[None, :]
    x = tl.load(h_rows + ks[None, :], mask=tmask & km, other=0.0)
    x = _bf16_to_f32(x) if H_BF16 else x.to(tl.float32)
    wt = tl.load(w_rows + ks[None, :], mask=km, other=0.0)
    return acc + tl.sum(x[:, None, :] * wt[None, :, :], axis=2)  # FP32 FMAs, no tl.dot


@triton.jit
def _router_gemv_kernel(h_ptr, wt_ptr, part_ptr, bias_ptr, w_out_ptr, id_out_ptr, count_ptr,
                        T, H, stride_h, stride_w,
                        E: tl.constexpr, NG: tl.constexpr, TOPK_GROUP: tl.constexpr,
                        TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                        BLOCK_K: tl.constexpr, K_STEPS: tl.constexpr, SPLIT: tl.constexpr,
                        H_BF16: tl.constexpr, FUSE: tl.constexpr, SEL_T: tl.constexpr,
                        ON_GPU: tl.constexpr):
    pe, pk, pt = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    toks = pt * BLOCK_T + tl.arange(0, BLOCK_T)
    exps = pe * BLOCK_E + tl.arange(0, BLOCK_E)
    k_base = pk * (K_STEPS * BLOCK_K)
    h_rows = h_ptr + toks.to(tl.int64)[:, None] * stride_h
    w_rows = wt_ptr + exps.to(tl.int64)[:, None] * stride_w
    tmask = (toks < T)[:, None]
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    if K_STEPS <= 4:  # decode: unrolled, so every weight load of the program is issued at once
        for i in tl.static_range(K_STEPS):
            acc = _gemv_step(h_rows, w_rows, tmask, k_base + i * BLOCK_K, H, acc, BLOCK_K, H_BF16)
    else:
        for i in range(K_STEPS):
            acc = _gemv_step(h_rows, w_rows, tmask, k_base + i * BLOCK_K, H, acc, BLOCK_K, H_BF16)
    part = part_ptr + pk * T * E + toks.to(tl.int64)[:, None] * E + exps[None, :]
    tl.store(part, acc, mask=tmask)
    if FUSE:
        # Last program done selects for every token. The barrier orders all threads' partial
        # stores before the (acq_rel, gpu-scope) increment that publishes them.
        tl.debug_barrier()
        total = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
        done = tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu")
        if done == total - 1:
            tl.debug_barrier()
            for t0 in range(0, T, SEL_T):
                _route_tokens(part_ptr, bias_ptr, w_out_ptr, id_out_ptr, t0, T, SPLIT,
                              E, NG, TOPK_GROUP, TOP_K, SEL_T, ON_GPU)
            tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")  # ready for the next call


@triton.jit
def _split3(w):
    # w = w1 + w2 + w3 exactly, each a BF16 value held in FP32: clearing the low 16 bits keeps
    # the top 8 significant bits (w - w1 is exact: its bits are w's lower ones), twice.
    w1 = (w.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)
    r = w - w1
    w2 = (r.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)
    return w1, w2, r - w2


@triton.jit
def _tc_dot(x, w, acc, ON_GPU: tl.constexpr):
    # acc + x @ w^T on BF16 tensor cores (w one BF16-exact term held in FP32). The interpreter
    # misreads BF16 tl.dot operands; FP32 ones hold the same values and give the same products.
    if ON_GPU:
        return tl.dot(x, tl.trans(w.to(tl.bfloat16)), acc)
    else:
        return tl.dot(_bf16_to_f32(x), tl.trans(w), acc, input_precision="ieee")


@triton.jit
def _router_tc_kernel(h_ptr, wt_ptr, part_ptr, T, H, stride_h, stride_w, E: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                      K_STEPS: tl.constexpr, ON_GPU: tl.constexpr):
    # Tokens x experts tiles, a K slice per program: each FP32 weight tile split into three BF16
    # terms, each times the BF16 activations, the smallest first; partials in split order.
    pe, pk, pt = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    toks = pt * BLOCK_T + tl.arange(0, BLOCK_T)
    exps = pe * BLOCK_E + tl.arange(0, BLOCK_E)
    h_rows = h_ptr + toks.to(tl.int64)[:, None] * stride_h
    w_rows = wt_ptr + exps.to(tl.int64)[:, None] * stride_w
    tmask = (toks < T)[:, None]
    emask = (exps < E)[:, None]
    acc = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for i in range(K_STEPS):
        ks = pk * (K_STEPS * BLOCK_K) + i * BLOCK_K + tl.arange(0, BLOCK_K)
        km = (ks < H)[None, :]
        x = tl.load(h_rows + ks[None, :], mask=tmask & km, other=0.0)
        w1, w2, w3 = _split3(tl.load(w_rows + ks[None, :], mask=emask & km, other=0.0))
        # A fresh tensor-core sum each K step, added to the total on the CUDA cores (FP32, round
        # to nearest): tensor cores need not round their FP32 sums to nearest (measured ones
        # truncate), and one accumulator through all of K would carry that bias to the logits.
        p = _tc_dot(x, w3, tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32), ON_GPU)
        p = _tc_dot(x, w2, p, ON_GPU)
        acc += _tc_dot(x, w1, p, ON_GPU)
    part = part_ptr + pk * T * E + toks.to(tl.int64)[:, None] * E + exps[None, :]
    tl.store(part, acc, mask=tmask & (exps < E)[None, :])


@triton.jit
def _router_select_kernel(part_ptr, bias_ptr, w_out_ptr, id_out_ptr, T, SPLIT: tl.constexpr,
                          E: tl.constexpr, NG: tl.constexpr, TOPK_GROUP: tl.constexpr,
                          TOP_K: tl.constexpr, SEL_T: tl.constexpr, ON_GPU: tl.constexpr):
    _route_tokens(part_ptr, bias_ptr, w_out_ptr, id_out_ptr, tl.program_id(0) * SEL_T, T, SPLIT,
                  E, NG, TOPK_GROUP, TOP_K, SEL_T, ON_GPU)


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
    if not (_pow2(e) and _pow2(n_group) and e % n_group == 0 and e // n_group >= 2):
        raise ValueError(f"router needs a power-of-2 expert count split into a power-"
                         f"of-2 number of groups of >= 2; got E={e}, n_group={n_group}")
    if not (1 <= topk_group <= n_group and _pow2(top_k) and top_k <= 32
            and top_k <= topk_group * (e // n_group)):
        raise ValueError(f"router needs 1 <= topk_group <= n_group and a power-of-2 "
                         f"top_k <= 32 within the kept groups; got topk_group={topk_group}, "
                         f"top_k={top_k}, n_group={n_group}, E={e}")
    if 40 * h.shape[0] * e >= 2**31:
        raise ValueError(f"router indexes its partial logits in int32; T={h.shape[0]} "
                         f"tokens x E={e} experts is too many: split the batch")
    if h.stride(1) != 1 or weight.stride(1) != 1 or bias.stride(0) != 1:
        raise ValueError(f"router needs unit stride along H and E; strides h {h.stride()}, weight "
                         f"{weight.stride()}, bias {bias.stride()}: pass .contiguous() tensors")
    if not h.device == weight.device == bias.device:
        raise ValueError(f"h on {h.device}, weight on {weight.device}, bias on {bias.device}")


# Above this many tokens the FMA tiles gave one wrong logit row at T=2048 on an H200 (not yet
# understood); the cuBLAS logits are used there whatever the config says.
FMA_TILES_MAX_T = 64


def default_config(t: int, on_gpu: bool = True) -> dict:
    """Decode: one fused kernel at T <= 2, two above (parallel one-warp selections); from 9
    tokens on a GPU the reference's cuBLAS GEMM, then the selection kernel. Each bucket's values
    are the fastest correct ones of a sweep on an H200. The CPU (interpreter) keeps the FMA
    tiles up to 64 tokens: speed does not matter there, and they are the Triton path to judge."""
    if t <= 2:  # 640 one-warp programs, each one 8 KB weight load issued at once (K_STEPS = 1);
        # one warp also keeps the fused selection's reductions inside a warp (no barriers)
        return {"BLOCK_T": 1 if t <= 1 else 2, "BLOCK_E": 8 if t <= 1 else 4, "BLOCK_K": 256,
                "SPLIT_K": 20, "FUSE": 1, "SEL_T": 2, "num_warps": 1, "SEL_WARPS": 1,
                "LIB_GEMM": 0}
    if t <= 4:  # 640 two-warp programs of one 256-wide step; one selection program per token
        return {"BLOCK_T": 4, "BLOCK_E": 8, "BLOCK_K": 256, "SPLIT_K": 20, "FUSE": 0,
                "SEL_T": 1, "num_warps": 2, "SEL_WARPS": 1, "LIB_GEMM": 0}
    if t <= _FUSE_MAX_T:  # 1280 two-warp programs (4 experts x 2 KB steps)
        return {"BLOCK_T": triton.next_power_of_2(t), "BLOCK_E": 4, "BLOCK_K": 128,
                "SPLIT_K": 20, "FUSE": 0, "SEL_T": 1, "num_warps": 2, "SEL_WARPS": 1,
                "LIB_GEMM": 0}
    if t <= FMA_TILES_MAX_T and not on_gpu:  # 16-token blocks x 320 GEMV programs
        return {"BLOCK_T": 16, "BLOCK_E": 8, "BLOCK_K": 64, "SPLIT_K": 10, "FUSE": 0,
                "SEL_T": 1, "num_warps": 4, "SEL_WARPS": 1, "LIB_GEMM": 0}
    # From 9 tokens an FP32 GEMM through cuBLAS (the reference's own call, so its logits are
    # bitwise the reference's) beats CUDA-core FMAs in Triton: 26-28 us against 38-103 at 16-64.
    return {"BLOCK_T": 16, "BLOCK_E": 16, "BLOCK_K": 32, "SPLIT_K": 1, "FUSE": 0, "SEL_T": 1,
            "num_warps": 4, "SEL_WARPS": 1, "LIB_GEMM": 1}


def _counter(device: torch.device) -> torch.Tensor:
    key = (device.type, device.index)
    if key not in _COUNTERS:  # zeroed once; the last program of every fused call re-zeroes it
        _COUNTERS[key] = torch.zeros(1, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def _lib_logits(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    # The reference's GEMM call (FP32 cuBLAS on the GPU; TF32 off unless the caller enabled it).
    return F.linear(h.float(), weight).contiguous()


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
    sel_t = min(int(cfg["SEL_T"]), triton.next_power_of_2(t))
    tc = int(cfg.get("TC_GEMM", 0)) and h.dtype == torch.bfloat16  # exact only for BF16 h
    if int(cfg.get("LIB_GEMM", 0)) or (t > FMA_TILES_MAX_T and not tc):
        part, split = _lib_logits(h, weight), 1
    elif tc:
        block_t = int(cfg.get("TC_BLOCK_T", 16))
        block_e = max(16, min(int(cfg.get("TC_BLOCK_E", 32)), e))
        block_k = int(cfg["BLOCK_K"])
        split = max(1, min(int(cfg["SPLIT_K"]), triton.cdiv(hid, block_k)))
        k_steps = triton.cdiv(triton.cdiv(hid, split), block_k)
        split = triton.cdiv(hid, k_steps * block_k)  # no empty K slice
        part = torch.empty((split, t, e), dtype=torch.float32, device=h.device)
        _router_tc_kernel[(triton.cdiv(e, block_e), split, triton.cdiv(t, block_t))](
            h, weight, part, t, hid, h.stride(0), weight.stride(0), E=e, BLOCK_T=block_t,
            BLOCK_E=block_e, BLOCK_K=block_k, K_STEPS=k_steps, ON_GPU=h.is_cuda,
            num_warps=int(cfg["num_warps"]))
    else:
        block_t, block_k = int(cfg["BLOCK_T"]), int(cfg["BLOCK_K"])
        block_e = min(int(cfg["BLOCK_E"]), e)
        split = max(1, min(int(cfg["SPLIT_K"]), triton.cdiv(hid, block_k)))
        k_steps = triton.cdiv(triton.cdiv(hid, split), block_k)
        fuse = bool(cfg["FUSE"]) and t <= 64
        part = torch.empty((split, t, e), dtype=torch.float32, device=h.device)
        counter = _counter(h.device) if fuse else part
        grid = (e // block_e, split, triton.cdiv(t, block_t))
        _router_gemv_kernel[grid](
            h, weight, part, bias, w_out, id_out, counter, t, hid, h.stride(0), weight.stride(0),
            BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=block_k, K_STEPS=k_steps, SPLIT=split,
            H_BF16=h.dtype == torch.bfloat16, FUSE=fuse, SEL_T=sel_t,
            num_warps=int(cfg["num_warps"]), **meta,
        )
        if fuse:
            return w_out, id_out
    _router_select_kernel[(triton.cdiv(t, sel_t),)](
        part, bias, w_out, id_out, t, SPLIT=split, SEL_T=sel_t, num_warps=int(cfg["SEL_WARPS"]),
        **meta,
    )
    return w_out, id_out


def run(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, n_group: int,
        topk_group: int, top_k: int, config: dict | None = None):
    """router(h[T,H] bf16, weight[E,H] fp32, bias[E] fp32, n_group, topk_group, top_k)
    -> (weights[T,k] fp32, ids[T,k] int64)."""
    # A tuned config (per bucket) wins; without one each bucket keeps its own default.
    cfg = {**default_config(h.shape[0] if h.dim() == 2 else 1, h.is_cuda), **(config or {})}
    return router_fwd(h, weight, bias, int(n_group), int(topk_group), int(top_k), cfg)
