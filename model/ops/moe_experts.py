"""moe_experts(x[T,H], gate_up[E,2I,H], down[E,H,I], weights[T,k] fp32, ids[T,k] int64, scale)
-> [T,H]

The routed experts as transformers' default `grouped_mm` backend computes them (docs/numerics.md
"MoE combine"): per slot, gu = bf(x @ gate_up[e]^T); a = swiglu(gu[:I], gu[I:]);
d_k = bf(a @ down[e]^T); s_k = f32(d_k) * w_k; y = bf(sum_k s_k) summed over the k slots in
torch's dim-1 order (on CUDA (((s0+s4)+(s1+s5))+(s2+s6))+(s3+s7); on CPU left to right in the
columns its vectorised loop covers and in the CUDA order in the columns past its last full vector
block, e.g. columns 192..221 of H = 222 with AVX-512, which is what transformers computes there
too); out = bf(f32(y) * scale), scale = routed_scaling_factor.
With expert parallelism `ids` may name experts this rank does not hold: pass `expert_offset`
and the slots outside [offset, offset + E) contribute zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._contract import Cost, Numerics, Shape, gen, randn
from .swiglu import reference as swiglu

NAME = "moe_experts"
SIGNATURE = (
    "moe_experts(x[T,H] bf16, gate_up[E,2I,H] bf16, down[E,H,I] bf16, weights[T,k] fp32, "
    "ids[T,k] int64, scale: float, expert_offset: int = 0) -> [T,H] bf16"
)
AXES = {
    "T": "tokens",
    "H": "hidden",
    "E": "experts/rank",
    "I": "moe intermediate/rank",
    "k": "top-k",
}

# Test shapes (model/ops/_contract.py "Test shapes"). The reference loops over experts in
# Python: few tokens on CPU.
CPU_DIMS = {"H": 320, "E": 16, "I": 64, "k": 8}
FREE_DIMS = {"H": (8, 512), "I": (8, 128)}
TOKEN_RANGE = {"cpu": (1, 24)}
EDGE_SCALES = {"tiny": {0: 2.0**-30}, "huge": {0: 2.0**20}}
# Expert parallelism, as the served model calls the op on an EP rank: ids of every rank's
# experts and this rank's offset (two and eight ranks; eight tokens so that some rows have no
# local expert and some several).
EDGE_SHAPES = {"expert_parallel_2": {"T": 8, "ep": 2}, "expert_parallel_8": {"T": 8, "ep": 8}}


def expert_slots(x, gate_up, down, ids, expert_offset: int = 0) -> torch.Tensor:
    """[T, k, H] BF16 expert outputs d_k per (token, slot); zero for experts not held here."""
    t, k = ids.shape
    out = torch.zeros(t, k, x.shape[1], dtype=x.dtype, device=x.device)
    local = ids - expert_offset
    for e in torch.unique(local).tolist():
        if not 0 <= e < gate_up.shape[0]:
            continue
        tok, slot = torch.where(local == e)
        gu = F.linear(x[tok], gate_up[e])
        inter = gu.shape[-1] // 2
        out[tok, slot] = F.linear(swiglu(gu[:, :inter], gu[:, inter:]), down[e])
    return out


def combine(slots: torch.Tensor, weights: torch.Tensor, scale: float) -> torch.Tensor:
    # BF16 d_k times FP32 w_k promotes to FP32; torch's dim-1 sum order; one rounding; then x scale.
    y = (slots * weights.unsqueeze(-1)).sum(dim=1).to(slots.dtype)
    return y * scale


def reference(x, gate_up, down, weights, ids, scale: float, expert_offset: int = 0):
    return combine(expert_slots(x, gate_up, down, ids, expert_offset), weights, scale)


def _bf16_index_add(x, gate_up, down, weights, ids, scale, expert_offset=0):
    # Near miss: transformers' `eager` backend: BF16 weighted outputs accumulated in BF16.
    slots = expert_slots(x, gate_up, down, ids, expert_offset)
    contrib = (slots.float() * weights.unsqueeze(-1)).to(x.dtype)
    y = torch.zeros_like(x)
    for k in range(ids.shape[1]):
        y = y + contrib[:, k]
    return y * scale


def _scale_in_weights(x, gate_up, down, weights, ids, scale, expert_offset=0):
    # Near miss: the routed scale folded into the FP32 weights (one rounding fewer).
    slots = expert_slots(x, gate_up, down, ids, expert_offset)
    return (slots * (weights * scale).unsqueeze(-1)).sum(dim=1).to(x.dtype)


def _pairwise_sum(x, gate_up, down, weights, ids, scale, expert_offset=0):
    # Near miss: FP32 slot sum as a neighbour-pair tree, ((s0+s1)+(s2+s3))+..., which is
    # neither torch's CUDA order nor its CPU (sequential) order.
    s = expert_slots(x, gate_up, down, ids, expert_offset).float() * weights.unsqueeze(-1)
    while s.shape[1] > 1:
        if s.shape[1] % 2:
            s = torch.cat([s, torch.zeros_like(s[:, :1])], dim=1)
        s = s[:, 0::2] + s[:, 1::2]
    return s[:, 0].to(x.dtype) * scale


def slot_sizes(x, gate_up, down, ids, expert_offset: int = 0) -> torch.Tensor:
    """[T, k, H] FP32 max(|d_k|, sqrt(sum_i (a_i down[h, i])^2)): the size of each slot's
    output, or of the terms its down GEMM adds where they cancel (zero where held elsewhere).
    The root-sum-square is the scale a dot product's rounding differences move by: a GEMM in
    another K order flips a few BF16 roundings of gu (so of a) and of d_k, each by one ulp of
    its own term, and those add up like a random walk over the terms, not over |d_k|."""
    t, k = ids.shape
    out = torch.zeros(t, k, x.shape[1], dtype=torch.float32, device=x.device)
    local = ids - expert_offset
    for e in torch.unique(local).tolist():
        if not 0 <= e < gate_up.shape[0]:
            continue
        tok, slot = torch.where(local == e)
        gu = F.linear(x[tok], gate_up[e])
        inter = gu.shape[-1] // 2
        a = swiglu(gu[:, :inter], gu[:, inter:]).float()
        w = down[e].float()
        d = F.linear(a, w)
        out[tok, slot] = torch.maximum(d.abs(), F.linear(a * a, w * w).sqrt())
    return out


def combine_magnitude(x, gate_up, down, weights, ids, scale: float, expert_offset: int = 0):
    """[T, H] FP32 scale * sum_k |w_k| * slot_sizes_k: the size of the terms the combine adds,
    each slot counted at least at its GEMM's terms' scale (both sums cancel)."""
    sizes = slot_sizes(x, gate_up, down, ids, expert_offset)
    return (sizes * weights.float().abs().unsqueeze(-1)).sum(dim=1) * scale


NUMERICS = Numerics(
    kind="ulp",
    # Ulps counted at max(|ref|, combine_magnitude): the slot outputs cancel, and so do the
    # terms of each slot's down GEMM, so a GEMM in another K order (any library but the
    # reference's own cuBLAS call) that flips one rounding of gu or d_k moves a near-zero output
    # by up to hundreds of its own ulps, yet by a few ulps at the terms' scale. Each slot counts
    # at least at the root-sum-square of its GEMM's terms: without that, rows where one slot is
    # held on this rank (expert parallelism; the combine cannot hide a small d_k there) showed
    # up to 9239 ulps on an H200 for an honest kernel (a model of one-ulp flips in 1-5% of gu
    # and d_k values: 280-2269 ulps before, at most 4 after; tests/test_kernels_moe.py).
    # Calibrated on the GPU, where the reference's per-expert cuBLAS GEMMs
    # round gu and d_k differently from any other kernel (H200, a TP8 rank's shapes, skewed
    # routing, T = 1..2048): two independent implementations (a fused Triton kernel and torch's
    # grouped_mm) agreed with each other and differed from the reference by up to 3 ulps at the
    # terms' scale (T = 2048) on up to 7.8% of the outputs (T = 8; 3.4-5.0% elsewhere). On the
    # CPU the same kernels differ by at most 2 ulps on under 5%. Bounds: one ulp and ~1.5x the
    # fraction of headroom. The near misses stay far outside: the BF16 accumulation differs in
    # ~52% of the outputs, the folded scale in ~27%, a truncated final rounding in ~43%, and a
    # dropped slot by tens of ulps; the harness also judges bias and requires a candidate to be
    # strictly closer to the reference than to every near miss.
    max_ulp=4,
    max_mismatch_fraction=0.12,
    near_misses={
        "bf16_index_add": _bf16_index_add,
        "scale_in_weights": _scale_in_weights,
        "pairwise_sum": _pairwise_sum,
    },
    note=("ulps at the scale of the combined terms (combine_magnitude: each slot at least at the "
          "root-sum-square of its down GEMM's terms), not of the output alone"),
    magnitude=combine_magnitude,
)


POOL = 16  # experts drawn independently; more are scaled copies (a rank's 256 take 25 s on CPU)


def expert_weights(e: int, rows: int, cols: int, g, dtype, device, scale: float):
    """[e, rows, cols]: POOL independent normal matrices; expert j >= POOL is matrix j % POOL
    with every row scaled by its own factor in [0.5, 1.5), so no two experts are equal or
    proportional (a kernel that reads the wrong expert is still caught) and E = 256 is cheap."""
    if torch.device(device).type == "cuda":
        # Drawn on the GPU from a seed drawn from `g`: a rank's pool is 300M normals, seconds on
        # the CPU for every case the judge makes (same seed, same values on the same GPU kind;
        # they differ from the CPU draw, which nothing compares across devices).
        dg = torch.Generator(device=device)
        dg.manual_seed(int(torch.randint(0, 2**62, (1,), generator=g)))
        pool = torch.randn((min(e, POOL), rows, cols), generator=dg, device=device) * scale
        row_scale = 0.5 + torch.rand((e, rows, 1), generator=dg, device=device)
    else:
        pool = randn((min(e, POOL), rows, cols), g, torch.float32, "cpu", scale=scale).to(device)
        row_scale = None
    if e <= POOL:
        return pool.to(dtype)
    if row_scale is None:
        row_scale = (0.5 + torch.rand((e, rows, 1), generator=g)).to(device)
    out = torch.empty((e, rows, cols), dtype=dtype, device=device)
    for j in range(e):
        out[j] = (pool[j % POOL] if j < POOL else pool[j % POOL] * row_scale[j]).to(dtype)
    return out


def routing_weights(n: int) -> torch.Tensor:
    """The test inputs' skewed expert popularity over n experts (unnormalised)."""
    return torch.linspace(3.0, 0.2, n)


def expected_touched(t: int, e: int, k: int, ep: int = 1) -> float:
    """Distinct experts of this rank the test inputs' routing hits, on average: expert j is in
    a token's k draws with probability ~ min(1, k pi_j) (without replacement, to first order;
    exactly k per token), so in 1 - (1 - that)^T of calls. Under expert parallelism the rank
    holds E of the ep * E experts, averaged over ranks."""
    pi = routing_weights(e * ep).double()
    q = (k * pi / pi.sum()).clamp(max=1.0)
    return float((1.0 - (1.0 - q) ** t).sum()) / ep


def make_inputs(shape: Shape, seed: int, device="cpu", dtype=torch.bfloat16) -> tuple:
    g = gen(seed)
    t, h, e, i, k = shape["T"], shape["H"], shape["E"], shape["I"], shape.get("k", 8)
    ep = int(shape.get("ep", 1))
    x = randn((t, h), g, dtype, device)
    gate_up = expert_weights(e, 2 * i, h, g, dtype, device, h**-0.5)
    down = expert_weights(e, h, i, g, dtype, device, i**-0.5)
    # Unbalanced routing on purpose: experts drawn from a skewed distribution, distinct per token.
    # Under expert parallelism (`ep` ranks of E experts) ids name all ep * E experts, and this
    # rank holds [offset, offset + E): the other slots contribute zero. Never rank 0, whose offset
    # is zero: there a kernel that ignores the offset is exact.
    probs = routing_weights(e * ep)
    ids = torch.stack([torch.multinomial(probs, k, generator=g) for _ in range(t)]).to(device)
    w = torch.rand((t, k), generator=g) + 0.05
    w = (w / w.sum(-1, keepdim=True)).to(device)
    if ep == 1:
        return x, gate_up, down, w, ids, 2.5
    return x, gate_up, down, w, ids, 2.5, e * int(torch.randint(1, ep, (1,), generator=g))


def cost(shape: Shape) -> Cost:
    t, h, e, i, k = shape["T"], shape["H"], shape["E"], shape["I"], shape.get("k", 8)
    # Each touched expert's weights are read once: `touched` where a caller counted them (a
    # profiled step's routing), else what the test inputs' routing hits on average (at T = 32
    # over 256 experts ~163, not min(E, T*k) = 256: that floor was above what kernels reach).
    touched = shape.get("touched")
    if touched is None:
        touched = min(e, t * k, expected_touched(t, e, k, int(shape.get("ep", 1))))
    return Cost(
        bytes=int(2 * (touched * 3 * i * h + 2 * t * h) + 12 * t * k),
        flops=2 * t * k * 3 * i * h
    )


def shapes_for(cfg, tokens: int, shard=None) -> dict[str, int]:
    return {
        "T": tokens,
        "H": cfg.hidden_size,
        "E": shard.num_experts if shard else cfg.num_experts,
        "I": shard.moe_intermediate_size if shard else cfg.moe_intermediate_size,
        "k": cfg.num_experts_per_tok,
    }
