"""ulp distances, the numerics policies (CPU vs cuda), the bias test and router tie handling."""

from __future__ import annotations

import pytest
import torch

from autoopt.eval.numerics import (
    NAN_ULP,
    OutputStats,
    Policy,
    effective_policy,
    judge,
    mismatch_count,
    ordered,
    router_tie_rows,
    ulp_diff,
)
from model.ops import contract


def _next_up(t: torch.Tensor, steps: int = 1) -> torch.Tensor:
    width = torch.int16 if t.element_size() == 2 else torch.int32
    b = t.view(width)
    # Toward +inf: positive patterns grow, negative ones shrink in magnitude.
    return torch.where(b >= 0, b + steps, b - steps).to(width).view(t.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("steps", [1, 3, 17])
def test_ulp_distance_counts_representable_steps(dtype, steps):
    x = (torch.randn(123) * 7).to(dtype)
    y = _next_up(x, steps)
    assert torch.equal(ulp_diff(y, x), torch.full((123,), steps, dtype=torch.int64))
    assert torch.equal(ulp_diff(x, y), torch.full((123,), -steps, dtype=torch.int64))


def test_ulp_distance_across_zero_and_nan():
    z = torch.tensor([0.0, -0.0], dtype=torch.bfloat16)
    assert ulp_diff(z[:1], z[1:]).item() == 0  # +0 and -0 are the same value
    tiny = torch.tensor([0.0], dtype=torch.bfloat16).view(torch.int16).add(1).view(torch.bfloat16)
    assert ulp_diff(tiny, -tiny).item() == 2  # smallest subnormals either side of zero
    nan = torch.tensor([float("nan")], dtype=torch.float32)
    one = torch.tensor([1.0])
    assert ulp_diff(nan, nan).item() == 0
    assert ulp_diff(nan, one).item() == NAN_ULP
    assert torch.equal(ordered(torch.tensor([1.0, -1.0])), -ordered(torch.tensor([-1.0, 1.0])))


def test_bitwise_policy_is_strict_on_cuda_and_stated_on_cpu():
    sw = contract("swiglu").numerics
    cuda = effective_policy(sw, torch.bfloat16, "cuda")
    cpu = effective_policy(sw, torch.bfloat16, "cpu")
    assert (cuda.kind, cuda.max_ulp) == ("bitwise", 0)
    # No looser than the interpreter needs: honest kernels are exact in BF16 there, and within one
    # FP32 ulp in ~0.6% of logit_softcap's values, all one way (no bias test there).
    assert (cpu.kind, cpu.max_ulp, cpu.max_mismatch_fraction) == ("ulp", 1, 1e-4)
    assert "strict on cuda" in cpu.describe()
    soft = effective_policy(contract("logit_softcap").numerics, torch.float32, "cpu")
    assert (soft.max_ulp, soft.max_mismatch_fraction, soft.judge_bias) == (1, 0.02, False)
    ids = effective_policy(contract("router").numerics, torch.int64, "cuda")
    assert ids.kind == "exact"


def test_judge_counts_elements_over_the_bound():
    ref = torch.randn(1000).to(torch.bfloat16)
    cand = ref.clone()
    cand[:3] = _next_up(ref[:3], 1)
    cand[3:5] = _next_up(ref[3:5], 2)
    stats = OutputStats()
    stats.add(cand, ref)
    policy = Policy("ulp", 1, 0.01, True, "")
    reasons = judge(policy, stats, "output 0")
    assert reasons == [
        "numerics: output 0: 2 elements > 1 ulp, max 2 (policy ulp(1, 0.01))"]
    strict = judge(Policy("bitwise", 0, 0.0, False, "strict on cuda"), stats, "output 0")
    assert "5 of 1000 elements differ" in strict[0]


def test_bias_test_catches_truncation_but_not_noise():
    # Truncation toward zero: every mismatch moves toward smaller magnitude.
    ref = (torch.randn(4000) * 3).to(torch.bfloat16)
    shrink = ref.view(torch.int16) - 1
    truncated = torch.where(torch.arange(4000) % 2 == 0, shrink, ref.view(torch.int16))
    truncated = truncated.view(torch.bfloat16)
    stats = OutputStats()
    stats.add(truncated, ref)
    reasons = judge(Policy("ulp", 1, 1.0, True, ""), stats, "output 0")
    assert any("biased error, mean magnitude-signed error -1.000" in r for r in reasons)
    # Random +-1 ulp noise (a different reduction order) is unbiased and passes.
    g = torch.Generator().manual_seed(0)
    sign = torch.randint(0, 2, (4000,), generator=g) * 2 - 1
    noisy = torch.where(torch.arange(4000) % 2 == 0, ref.view(torch.int16) + sign.to(torch.int16),
                        ref.view(torch.int16)).view(torch.bfloat16)
    stats = OutputStats()
    stats.add(noisy, ref)
    assert judge(Policy("ulp", 1, 1.0, True, ""), stats, "output 0") == []


def test_bias_counts_rows_not_elements():
    """An honest kernel whose row statistic differs by an FP32 ulp (rmsnorm's rsqrt) moves that
    row's roundings one way: 19 same-sign mismatches in 2 rows are not evidence of bias; the
    same truncation spread over every row is."""
    g = torch.Generator().manual_seed(1)
    ref = (torch.randn(64, 512, generator=g) * 3).to(torch.bfloat16)
    bits = ref.view(torch.int16)
    mag_up = bits + 1  # the next pattern: one ulp away from zero, either sign
    honest = bits.clone()
    honest[3, :10] = mag_up[3, :10]
    honest[40, 100:109] = mag_up[40, 100:109]
    stats = OutputStats()
    stats.add(honest.view(torch.bfloat16), ref)
    assert (stats.mismatches, stats.mismatched_rows) == (19, 2)
    assert judge(Policy("ulp", 1, 0.001, True, ""), stats, "output 0") == []
    spread = bits.clone()
    spread[:, :2] = mag_up[:, :2]  # 128 mismatches, 64 rows, all one way
    stats = OutputStats()
    stats.add(spread.view(torch.bfloat16), ref)
    assert stats.mismatched_rows == 64
    reasons = judge(Policy("ulp", 1, 0.01, True, ""), stats, "output 0")
    assert any("biased error, mean magnitude-signed error +1.000" in r for r in reasons)
    # Rows excluded by `keep` (router ties) count neither as mismatches nor as rows.
    keep = torch.ones_like(ref, dtype=torch.bool)
    keep[:32] = False
    stats = OutputStats()
    stats.add(spread.view(torch.bfloat16), ref, keep)
    assert (stats.mismatches, stats.mismatched_rows, stats.excluded) == (64, 32, 32 * 512)


def test_near_copies_of_a_trial_do_not_count_as_evidence_of_bias():
    """A follow-up call with one input element changed repeats the case's honest 1-ulp errors;
    twenty-three such copies of one mismatched row are one row of evidence, not 24. They are
    still judged on every other bound."""
    g = torch.Generator().manual_seed(2)
    ref = (torch.randn(17, 768, generator=g) * 3).to(torch.bfloat16)
    bits = ref.view(torch.int16)
    honest = bits.clone()
    honest[5, 7] = bits[5, 7] + 1  # one element one ulp away from zero
    cand = honest.view(torch.bfloat16)
    policy = Policy("ulp", 1, 0.05, True, "")
    as_rows, as_copies = OutputStats(), OutputStats()
    for k in range(24):
        as_rows.add(cand, ref)
        as_copies.add(cand, ref, bias=k == 0)
    assert any("biased error" in r for r in judge(policy, as_rows, "output 0"))
    assert judge(policy, as_copies, "output 0") == []
    assert (as_copies.mismatches, as_copies.bias_mismatches, as_copies.mismatched_rows) == \
        (24, 1, 1)
    over = honest.clone()
    over[5, 8] = bits[5, 8] + 3  # a copy is still held to max_ulp
    as_copies.add(over.view(torch.bfloat16), ref, bias=False)
    assert any("> 1 ulp" in r for r in judge(policy, as_copies, "output 0"))


def test_fraction_bound_has_a_poisson_margin_per_shape():
    from autoopt.eval.numerics import allowed_mismatches

    assert allowed_mismatches(320, 0.0) == 0  # bitwise: none
    assert allowed_mismatches(320, 1e-3) == 3  # 0.32 expected: rare noise passes on a small shape
    assert allowed_mismatches(1_000_000, 1e-3) == 1127  # ~ the fraction itself on a large one
    ref = torch.randn(320).to(torch.bfloat16)
    cand = ref.clone()
    cand[:20] = _next_up(ref[:20], 1)  # a deviation confined to one small shape: 6% of it
    stats = OutputStats()
    stats.add(cand, ref)
    assert any("mismatch fraction" in r for r in judge(Policy("ulp", 1, 1e-3, True, ""), stats,
                                                       "output 0 at T=1,H=320"))


def test_mismatch_count_handles_wrong_shapes():
    a = (torch.zeros(3, 4),)
    assert mismatch_count(a, (torch.zeros(3, 4),)) == 0
    assert mismatch_count(a, (torch.zeros(12),)) == 12


def _router_inputs(t: int = 17):
    c = contract("router")
    shape = {"T": t, "H": 64, "E": 256, "n_group": 8, "topk_group": 4, "top_k": 8}
    return c, c.make_inputs(shape, 0)


def test_router_ids_differing_without_a_tie_are_not_tolerated():
    c, args = _router_inputs()
    _, ids = c.reference(*args)
    other = ids.clone()
    other[3, 0] = (ids[3, 0] + 128) % 256  # an expert the reference did not pick at all
    ok, rows = router_tie_rows(args, ids, other)
    assert not ok[3] and rows[0]["row"] == 3 and rows[0]["tie"] is False


def test_router_tie_at_the_top_k_boundary_is_tolerated():
    c, args = _router_inputs()
    h, weight, bias, n_group, topk_group, top_k = args
    _, ids = c.reference(*args)
    scores = torch.sigmoid(torch.nn.functional.linear(h.float(), weight)) + bias
    # Make the 8th pick of token 5 tie exactly with an unpicked expert of the same group.
    row, last = 5, int(ids[5, -1])
    group = last // 32
    rival = next(e for e in range(group * 32, group * 32 + 32) if e not in ids[row].tolist())
    bias = bias.clone()
    bias[rival] += scores[row, last] - scores[row, rival]
    args = (h, weight, bias, n_group, topk_group, top_k)
    _, ids = c.reference(*args)
    picked, other = (last, rival) if last in ids[row].tolist() else (rival, last)
    swapped = ids.clone()
    swapped[row, swapped[row] == picked] = other  # the other side of the exact tie
    ok, rows = router_tie_rows(args, ids, swapped)
    assert bool(ok[row]) and rows[0]["tie"] is True


def _router_tie_in_slot_order(t: int = 17, row: int = 5):
    """Router inputs whose token `row` has two picked experts tied exactly in score, and the
    reference's outputs."""
    c, args = _router_inputs(t)
    h, weight, bias, n_group, topk_group, top_k = args
    _, ids = c.reference(*args)
    scores = torch.sigmoid(torch.nn.functional.linear(h.float(), weight)) + bias
    a, b = int(ids[row, 1]), int(ids[row, 2])
    bias = bias.clone()
    bias[b] += scores[row, a] - scores[row, b]  # b now ties a exactly
    args = (h, weight, bias, n_group, topk_group, top_k)
    return c, args, c.reference(*args)


def test_router_slots_swapped_across_a_tie_are_compared_in_the_references_order():
    from autoopt.eval.numerics import align_tied_slots

    c, args, (w, ids) = _router_tie_in_slot_order()
    row = 5
    sw, sids = w.clone(), ids.clone()
    sw[row, [1, 2]], sids[row, [1, 2]] = w[row, [2, 1]], ids[row, [2, 1]]  # the other order
    ok, rows = router_tie_rows(args, ids, sids)
    assert bool(ok[row]) and rows[0]["tie"] is True
    (aw, aids), still = align_tied_slots((w, ids), (sw, sids), ok)
    assert torch.equal(aids, ids) and torch.equal(aw, w) and not bool(still.any())
    # The same swap with a wrong weight stays visible: aligned, then compared in full.
    bad = sw.clone()
    bad[row, 1] = bad[row, 1] * 1.5
    (aw, _), _ = align_tied_slots((w, ids), (bad, sids), ok)
    assert not torch.equal(aw, w)


def test_judge_record_counts_no_mismatch_for_a_tied_slot_swap_and_catches_a_wrong_weight():
    from autoopt.eval.trials import Judge

    c, args, (w, ids) = _router_tie_in_slot_order()
    row = 5
    sw, sids = w.clone(), ids.clone()
    sw[row, [1, 2]], sids[row, [1, 2]] = w[row, [2, 1]], ids[row, [2, 1]]
    j = Judge(c, None, "cpu", {})
    j.record("k", args, (sw, sids), (w, ids))
    assert j.stats[("k", 0)].mismatches == 0 and j.stats[("k", 1)].mismatches == 0
    bad = sw.clone()
    bad[row, 2] = bad[row, 2] * 1.5  # the swapped slot's weight is wrong
    j.record("k", args, (bad, sids), (w, ids))
    assert j.stats[("k", 0)].mismatches == 1 and j.stats[("k", 1)].mismatches == 0
    # Swapping slots where nothing ties is not tolerated.
    other = 9
    nw, nids = w.clone(), ids.clone()
    nw[other, [0, 7]], nids[other, [0, 7]] = w[other, [7, 0]], ids[other, [7, 0]]
    j.record("k", args, (nw, nids), (w, ids))
    assert j.stats[("k", 1)].mismatches == 2


def _router_group_tie():
    """Router inputs of one token whose c = 0.5 + bias (h = 0), in 64ths (exact): groups 0-2
    clearly kept, groups 3 (10 + 8) and 4 (12 + 6) tied exactly for the last kept place,
    group 5 (9 + 8) just below; and the ids a kernel keeping a given set of groups returns."""
    e, h_dim = 256, 64
    bias = -0.45 - torch.arange(e, dtype=torch.float32) * 1e-4  # distinct, low: c ~ 0.05
    tops = {0: (40, 36, 7), 1: (32, 30), 2: (28, 26), 3: (10, 8), 4: (12, 6), 5: (9, 8)}
    for g, vals in tops.items():
        for i, v in enumerate(vals):
            bias[32 * g + 5 * i] = v / 64 - 0.5
    args = (torch.zeros(1, h_dim, dtype=torch.bfloat16), torch.randn(e, h_dim), bias, 8, 4, 8)
    c = 0.5 + bias

    def pick(groups):
        mask = torch.zeros(e, dtype=torch.bool)
        for g in groups:
            mask[32 * g:32 * g + 32] = True
        return torch.topk(c.masked_fill(~mask, float("-inf")), 8)[1][None]

    return args, pick


def test_router_kept_group_across_a_tie_is_tolerated_with_the_experts_it_brings():
    # Keeping group 4 instead of its exact tie group 3 brings 12/64 and, for the 8th place,
    # group 0's third expert (7/64): neither near the other choice's boundary (8/64), and
    # group 0's score nowhere near the tie; all of it is the same tie resolved the other way.
    args, pick = _router_group_tie()
    c = contract("router")
    _, ids = c.reference(*args)
    as3, as4 = pick([0, 1, 2, 3]), pick([0, 1, 2, 4])
    assert torch.equal(ids, as3) or torch.equal(ids, as4)
    assert set(as4[0].tolist()) - set(as3[0].tolist()) == {32 * 4, 10}
    other = as4 if torch.equal(ids, as3) else as3
    ok, rows = router_tie_rows(args, ids, other)
    assert bool(ok[0]) and rows[0]["tie"] is True
    # Group 5 is below the boundary by far more than noise: keeping it is wrong.
    ok, rows = router_tie_rows(args, ids, pick([0, 1, 2, 5]))
    assert not bool(ok[0]) and rows[0]["tie"] is False
    # The tied group's experts in the right set but out of score order: wrong.
    shuffled = other.clone()
    shuffled[0, [0, 1]] = other[0, [1, 0]]
    ok, _ = router_tie_rows(args, ids, shuffled)
    assert not bool(ok[0])
    # An expert twice, or one that does not exist: wrong.
    twice = other.clone()
    twice[0, 7] = twice[0, 6]
    assert not bool(router_tie_rows(args, ids, twice)[0][0])
    out_of_range = other.clone()
    out_of_range[0, 7] = 256
    assert not bool(router_tie_rows(args, ids, out_of_range)[0][0])


@pytest.mark.parametrize("ulps,tolerated", [(1, True), (8, True), (60, True), (200, False)])
def test_router_tie_tolerance_is_in_fp32_ulps(ulps, tolerated):
    # Two picked experts whose scores c = 0.5 + bias (h = 0) are `ulps` FP32 ulps apart, in the
    # other order: GEMM order moves c by a few FP32 ulps, so a kernel may honestly see them so.
    # (The tolerance once used FP64 ulps, 2**29 times smaller: no FP32 difference was a tie.)
    e, h_dim = 256, 64
    bias = -0.3 - torch.arange(e, dtype=torch.float32) * 1e-3
    bias[7] = 0.25  # c[7] = 0.75
    bias[8] = 0.25 - ulps * 2.0**-24  # c[8] = 0.75 - ulps FP32 ulps of 0.75, exactly
    args = (torch.zeros(1, h_dim, dtype=torch.bfloat16), torch.randn(e, h_dim), bias, 8, 4, 8)
    _, ids = contract("router").reference(*args)
    assert ids[0, :2].tolist() == [7, 8]
    swapped = ids.clone()
    swapped[0, [0, 1]] = ids[0, [1, 0]]
    ok, rows = router_tie_rows(args, ids, swapped)
    assert bool(ok[0]) is tolerated and rows[0]["tie"] is tolerated


def test_an_infinite_candidate_counts_as_far_off_not_as_an_overflow():
    # ceil(inf) has no int64: it once became INT64_MIN, whose abs is negative, and the per-ulp
    # count (bincount) raised. A cache slot left holding inf by a wrong write is judged instead.
    from autoopt.eval.numerics import ulp_diff_at

    ref = torch.tensor([1.0, -2.0, 0.5, 3.0]).to(torch.bfloat16)
    cand = torch.tensor([float("inf"), float("-inf"), 0.5, float("nan")]).to(torch.bfloat16)
    d = ulp_diff_at(cand, ref, torch.zeros(4))
    assert d[0] > 1000 and d[1] < -1000 and d[2] == 0 and abs(int(d[3])) >= 1 << 20
    stats = OutputStats()
    stats.add(cand, ref, magnitude=torch.zeros(4))
    assert stats.mismatches == 3 and stats.max_ulp > 1000
