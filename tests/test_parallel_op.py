"""The allreduce_norm_residual_norm contract and the single-process TPGroup (no processes)."""

from __future__ import annotations

import math

import pytest
import torch

from model.config import preset
from model.ops import CONTRACTS, OpTable, moe_experts, norm_residual_norm, rmsnorm
from model.ops import allreduce_norm_residual_norm as arn
from model.parallel import BOUNDARIES, TPGroup, attach, init_tp, launch, register_boundary


def _bf16_rne(x32: torch.Tensor) -> torch.Tensor:
    """FP32 -> BF16 round-to-nearest-even by integer arithmetic (independent of torch's cast)."""
    bits = x32.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return (rounded & 0xFFFF).to(torch.int32).to(torch.int16).view(torch.bfloat16)


def _ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """BF16 ulp distance per element (bit patterns mapped to a monotone integer line)."""
    def line(x):
        i = x.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -(i & 0x7FFF), i)
    return (line(a) - line(b)).abs()


def _independent_rank_sum(partials: torch.Tensor) -> torch.Tensor:
    # FP64 adds rounded to FP32 after each step equal FP32 adds (53 >= 2*24 + 2 bits).
    acc = partials[0].double()
    for r in range(1, partials.shape[0]):
        acc = (acc + partials[r].double()).float().double()
    return _bf16_rne(acc.float())


def _independent_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xd = x.double()
    y = w.double() * (xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + eps))
    return _bf16_rne(y.float())


def _independent_residual(p: torch.Tensor, residual: torch.Tensor, add_index: int) -> torch.Tensor:
    """h' = bf(f32(bf(p*a)) + f32(bf(h*b))) in FP64 with explicit roundings (docs/numerics.md)."""
    a, b = 1.0 / math.sqrt(add_index), math.sqrt((add_index - 1) / add_index)
    # bf16 x fp32-constant products are exact in FP64, so rounding to FP32 matches an FP32 mul;
    # the sum of two BF16 values is exact in FP64 too.
    pa = _bf16_rne((p.double() * torch.tensor(a).float().double()).float())
    hb = _bf16_rne((residual.double() * torch.tensor(b).float().double()).float())
    return _bf16_rne((pa.double() + hb.double()).float())


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("tokens", [1, 17, 123])
def test_rank_sum_is_fp32_in_rank_order_rounded_once(ranks, tokens):
    partials = arn.make_inputs({"R": ranks, "T": tokens, "H": 256}, seed=ranks * 100 + tokens)[0]
    assert torch.equal(arn.rank_sum(partials), _independent_rank_sum(partials))


@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("tokens", [1, 17, 123])
def test_reference_matches_independent_formulation(ranks, tokens):
    partials, residual, post_w, next_w, add_index, eps = arn.make_inputs(
        {"R": ranks, "T": tokens, "H": 5120}, seed=7 * ranks + tokens)
    got_x, got_h = arn.reference(partials, residual, post_w, next_w, add_index, eps)
    # Stage by stage, each on the reference's own input, so that one flip does not compound.
    post = rmsnorm.reference(_independent_rank_sum(partials), post_w, eps)
    assert torch.equal(got_h, _independent_residual(post, residual, add_index))
    for got, want in ((post, _independent_norm(_independent_rank_sum(partials), post_w, eps)),
                      (got_x, _independent_norm(got_h, next_w, eps))):
        ulps = _ulps(got, want)
        # FP32 vs FP64 mean-of-squares: the FP32 sum's relative error (~1e-6) flips outputs that
        # sit that close to a BF16 rounding midpoint by 1 ulp: under 1e-3 of them, never 2 ulps.
        assert int(ulps.max()) <= 1
        assert (ulps > 0).float().mean().item() <= 1e-3


def test_one_rank_is_norm_residual_norm():
    args = arn.make_inputs({"R": 1, "T": 17, "H": 64}, seed=3)
    got = arn.reference(*args)
    want = norm_residual_norm.reference(args[0][0], *args[1:])
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def _differs(fn, args) -> bool:
    ref = arn.reference(*args)
    out = fn(*args)
    return any(not torch.equal(o, r) for o, r in zip(out, ref, strict=True))


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("name", sorted(arn.NUMERICS.near_misses))
def test_near_misses_differ_from_reference(ranks, name):
    args = arn.make_inputs({"R": ranks, "T": 33, "H": 512}, seed=11)
    assert _differs(arn.NUMERICS.near_misses[name], args)


@pytest.mark.parametrize("name", sorted(arn.MULTI_RANK_NEAR_MISSES))
def test_multi_rank_near_misses_need_three_ranks(name):
    fn = arn.MULTI_RANK_NEAR_MISSES[name]
    # At R = 2 a per-step rounding is invisible (documented in the contract) ...
    assert not _differs(fn, arn.make_inputs({"R": 2, "T": 33, "H": 512}, seed=5))
    # ... from R = 3 on it shows.
    assert _differs(fn, arn.make_inputs({"R": 4, "T": 33, "H": 512}, seed=5))


def test_contract_registered_with_shapes_and_cost():
    c = CONTRACTS["allreduce_norm_residual_norm"]
    cfg = preset("beam-1.0-501b")
    assert c.shapes_for(cfg, 5, cfg.shard(8)) == {"R": 8, "T": 5, "H": 5120}
    assert c.shapes_for(cfg, 5) == {"R": 2, "T": 5, "H": 5120}
    small, large = c.cost({"R": 2, "T": 9, "H": 64}), c.cost({"R": 8, "T": 9, "H": 64})
    assert 0 < small.bytes < large.bytes and 0 < small.flops < large.flops
    table = OpTable()
    args = c.make_inputs({"R": 2, "T": 3, "H": 64}, seed=1)
    assert torch.equal(table.allreduce_norm_residual_norm(*args)[0], c.reference(*args)[0])


def _slice_experts(gate_up, down, ranks: int, rank: int, ep: bool):
    """The rank's experts (EP) or its slice of every expert's intermediate dim (TP)."""
    e, two_i, _ = gate_up.shape
    if ep:
        per = e // ranks
        sl = slice(rank * per, (rank + 1) * per)
        return gate_up[sl], down[sl], rank * per
    i, per = two_i // 2, two_i // 2 // ranks
    lo, hi = rank * per, (rank + 1) * per
    return torch.cat([gate_up[:, lo:hi], gate_up[:, i + lo:i + hi]], 1), down[:, :, lo:hi], 0


@pytest.mark.parametrize("ep", [False, True])
@pytest.mark.parametrize("tokens", [1, 17])
def test_moe_partial_is_the_ranks_combined_experts(ep, tokens):
    # In FP32 the rank sum of per-rank combined (and scaled) expert outputs is the full layer up
    # to FP32 reassociation: this is how the combine happens before the rank sum.
    shape = {"T": tokens, "H": 64, "E": 16, "I": 32, "k": 8}
    x, gate_up, down, w, ids, scale = moe_experts.make_inputs(shape, seed=2, dtype=torch.float32)
    full = moe_experts.reference(x, gate_up, down, w, ids, scale)
    partials = []
    for rank in range(2):
        gu, dn, offset = _slice_experts(gate_up, down, 2, rank, ep)
        partials.append(moe_experts.reference(x, gu, dn, w, ids, scale, offset))
    # Outputs are O(1); FP32 sums over 64/32 terms reassociated: a few FP32 ulps.
    torch.testing.assert_close(arn.rank_sum(torch.stack(partials)), full, atol=1e-5, rtol=1e-5)


def test_single_rank_group_is_identity():
    group = init_tp(1, 0)
    t = torch.randn(5, 8)
    assert group.size == 1 and group.pg is None
    assert group.all_reduce(t) is t and group.all_gather_vocab(t) is t
    assert torch.equal(group.gather_partials(t), t[None])
    assert launch(_rank_and_size, 1) == [(0, 1)]


def _rank_and_size(group: TPGroup) -> tuple[int, int]:
    return group.rank, group.size


def test_single_rank_boundary_is_norm_residual_norm():
    group = init_tp(1, 0)
    args = norm_residual_norm.make_inputs({"T": 17, "H": 64}, seed=4)
    got = group.boundary(OpTable(), *args)
    want = norm_residual_norm.reference(*args)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_attach_checks_the_shard():
    from model.beam import BeamForCausalLM

    cfg = preset("tiny")
    model = BeamForCausalLM(cfg, cfg.shard(2), rank=1, dtype=torch.float32)
    with pytest.raises(ValueError, match="tp=1, rank=0"):
        attach(model, init_tp(1, 0))
    tp1 = attach(BeamForCausalLM(cfg, dtype=torch.float32), init_tp(1, 0))
    assert tp1.tp_boundary is None


def test_bad_arguments_say_what_to_do():
    with pytest.raises(ValueError, match="backend must be one of"):
        init_tp(2, 0, backend="mpi")
    with pytest.raises(ValueError, match="0 <= rank < tp"):
        init_tp(2, 2)
    with pytest.raises(ValueError, match="unknown TP boundary"):
        init_tp(1, 0, boundary_impl="nope")
    with pytest.raises(ValueError, match="already registered"):
        register_boundary("gather", BOUNDARIES["allreduce"])
