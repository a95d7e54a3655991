"""allreduce_norm_residual_norm(partials[R,T,H], residual[T,H], post_weight[H], next_weight[H],
add_index, eps) -> (normed_next[T,H], new_residual[T,H])

The sandwich-norm boundary under tensor parallelism (TP = R ranks). Each rank's branch output
is a partial sum: o_proj and the dense down projection are row-parallel, and a MoE rank's
partial is its own *combined* expert output (`moe_experts` on its intermediate slice, or on its
experts with EP: per-slot down products, FP32 weighted combine, one rounding, x routed scale),
so the expert combine happens before the rank sum. The boundary is
    branch = bf( f32(p_0) + f32(p_1) + ... + f32(p_{R-1}) )   # FP32, rank order, one rounding
    (normed_next, new_residual) = norm_residual_norm(branch, residual, ...)   (docs/numerics.md)
The FP32 sum in rank order is fixed so that the result is deterministic and identical on every
rank (the MoE router downstream must see the same bits everywhere); NCCL's own reduction order
and its per-step BF16 rounding are not guaranteed.

This single-process form takes the rank partials stacked ([R,T,H]), so the harness verifies it
like any other op. The distributed form (`model.parallel.TPGroup.boundary`) all-gathers the
partials and calls this op, so a fused kernel for this signature (rank sum + both norms in one
pass) speeds up the TP runtime directly; a one-shot peer-to-peer variant that reads the peers'
partials in place computes the same function. At R = 2 an all-reduce that adds the two BF16
partials once and rounds RNE equals `rank_sum` bitwise: one FP32 add of two BF16 values rounds
the same in either order (24 >= 2*8+2 bits, so the double rounding through FP32 is innocuous).
Checked for gloo in tests/test_parallel.py; benchmarks/tp_bench.py checks NCCL on GPUs.
"""

from __future__ import annotations

import torch

from . import norm_residual_norm as nrn
from ._contract import BIASED_ROW_SUMS, Cost, Numerics, Shape, gen, norm_weight, randn

NAME = "allreduce_norm_residual_norm"
SIGNATURE = (
    "allreduce_norm_residual_norm(partials[R,T,H] bf16, residual[T,H] bf16, post_weight[H] bf16, "
    "next_weight[H] bf16, add_index: int, eps: float) -> (normed_next[T,H], new_residual[T,H])"
)
AXES = {
    "R": "TP ranks (layout: 2, 4, 8)",
    "T": "tokens (varies)",
    "H": "hidden size (config)",
    "add_index": "2..105 (depth)",
}

# Test shapes (model/ops/_contract.py "Test shapes"): see `test_shapes` below.
CPU_DIMS = {"H": 320}
FREE_DIMS = {"H": (8, 640)}
# Every depth index once, on one row (as norm_residual_norm).
EDGE_SHAPES = {f"add_index={d}": {"T": 1, "add_index": d} for d in range(2, 106)}
TOKEN_RANGE = {"cpu": (1, 128)}
EDGE_SCALES = {"tiny": {0: 2.0**-40, 1: 2.0**-40}, "huge": {0: 2.0**40, 1: 2.0**40}}


def rank_sum(partials: torch.Tensor) -> torch.Tensor:
    """bf(((f32(p_0) + f32(p_1)) + f32(p_2)) + ...): FP32 in rank order, rounded once."""
    if partials.dim() < 2 or partials.shape[0] < 1:
        raise ValueError(f"partials must be [R, ...] with R >= 1, got {tuple(partials.shape)}")
    acc = partials[0].float()
    for r in range(1, partials.shape[0]):
        acc = acc + partials[r].float()
    return acc.to(partials.dtype)


def reference(partials, residual, post_weight, next_weight, add_index: int, eps: float):
    return nrn.reference(rank_sum(partials), residual, post_weight, next_weight, add_index, eps)


def magnitude(partials, residual, post_weight, next_weight, add_index: int, eps: float):
    """`norm_residual_norm.magnitude` of the rank sum: the residual add cancels here too."""
    return nrn.magnitude(rank_sum(partials), residual, post_weight, next_weight, add_index, eps)


def _unrounded_rank_sum(partials, residual, post_weight, next_weight, add_index, eps):
    # Near miss: the FP32 rank sum goes into the post-norm without its BF16 rounding (what a
    # fused kernel that keeps the sum in registers computes by accident).
    acc = partials[0].float()
    for r in range(1, partials.shape[0]):
        acc = acc + partials[r].float()
    p = nrn.rmsnorm(acc, post_weight, eps).to(residual.dtype)
    h = nrn.depth_scaled_add(p, residual, add_index)
    return nrn.rmsnorm(h, next_weight, eps), h


def _bf16_rank_chain(partials, residual, post_weight, next_weight, add_index, eps):
    # Near miss (R >= 3 only): a BF16 rounding after every add, as a ring all-reduce does.
    acc = partials[0]
    for r in range(1, partials.shape[0]):
        acc = (acc.float() + partials[r].float()).to(partials.dtype)
    return nrn.reference(acc, residual, post_weight, next_weight, add_index, eps)


def _with_boundary_near_miss(name: str):
    inner = nrn.NUMERICS.near_misses[name]

    def near_miss(partials, residual, post_weight, next_weight, add_index, eps):
        return inner(rank_sum(partials), residual, post_weight, next_weight, add_index, eps)

    near_miss.__name__ = f"_{name}"
    return near_miss


# Near misses that differ from the reference at every R >= 2.
_NEAR_MISSES = {"unrounded_rank_sum": _unrounded_rank_sum}
_NEAR_MISSES.update({name: _with_boundary_near_miss(name) for name in nrn.NUMERICS.near_misses})

# A per-step rounding coincides with the reference at R = 2 (one add, rounded once either way),
# so a verifier applies these only when R >= 3. A different FP32 summation order is no near miss:
# the FP32 sum of up to 8 BF16 values is exact unless their exponents span more than ~13 bits,
# so the order almost never shows (it is fixed anyway, for determinism).
MULTI_RANK_NEAR_MISSES = {"bf16_rank_chain": _bf16_rank_chain}

NUMERICS = Numerics(
    kind="ulp",
    max_ulp=3,  # as norm_residual_norm (ulps at the residual add's terms)
    # The rank sum is elementwise and exact given its order; the two hidden-size norms are the
    # only reductions, as in norm_residual_norm.
    max_mismatch_fraction=1e-3,
    near_misses=_NEAR_MISSES,
    magnitude=magnitude,
    judge_bias=False,
    note=("ulps at the scale of the residual add's terms, as in norm_residual_norm. With R >= 3 "
          "also apply MULTI_RANK_NEAR_MISSES (they equal the reference at R = 2). "
          + BIASED_ROW_SUMS),
)


def make_inputs(shape: Shape, seed: int, device="cpu", dtype=torch.bfloat16) -> tuple:
    g = gen(seed)
    r, t, h = shape["R"], shape["T"], shape["H"]
    # Row-parallel partials of a branch whose sum has scale ~3: partials of comparable size with
    # opposite signs in places, so the sum cancels and its rounding matters.
    partials = randn((r, t, h), g, dtype, device, scale=3.0 / r**0.5)
    residual = randn((t, h), g, dtype, device, scale=1.0)
    add_index = int(shape.get("add_index", 2 + int(torch.randint(0, 104, (1,), generator=g))))
    return (
        partials,
        residual,
        norm_weight(h, g, dtype, device),
        norm_weight(h, g, dtype, device),
        add_index,
        1e-6,
    )


def cost(shape: Shape) -> Cost:
    # Per rank: read the R partials (its own and R-1 received), the residual and two weights;
    # write the normed output and the new residual.
    r, t, h = shape["R"], shape["T"], shape["H"]
    return Cost(bytes=2 * ((r + 3) * t * h + 2 * h), flops=(r - 1) * t * h + 12 * t * h)


def shapes_for(cfg, tokens: int, shard=None) -> dict[str, int]:
    # The op exists only under TP; without a shard view the smallest TP layout (2) is used.
    ranks = shard.tp if shard is not None and shard.tp > 1 else 2
    return {"R": ranks, "T": tokens, "H": cfg.hidden_size}


def test_shapes(cfg, shard, tokens: int, kind: str) -> list[dict[str, int]]:
    """CPU: 2 ranks (one rounded pair sum), 3 and 8 (where per-step rounding shows), chosen by
    the token count; GPU: the target's TP degree."""
    if kind == "cpu":
        return [{"R": (2, 3, 8)[tokens % 3], "T": tokens, **CPU_DIMS}]
    return [shapes_for(cfg, tokens, shard)]
