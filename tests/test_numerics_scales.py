"""The error scales (`Numerics.magnitude`) of attention and the sandwich-norm boundary: honest
reduction orders stay within the policy where the reference's own roundings amplify them, the
scale widens only there, and a wrong answer is still far outside it."""

from __future__ import annotations

import pytest
import torch

from autoopt.eval.numerics import ulp_diff, ulp_diff_at
from model.ops import attention as attn
from model.ops import contract
from model.ops import norm_residual_norm as nrn
from model.ops.rmsnorm import reference as rmsnorm

BF16 = torch.bfloat16


def _flipped_top_scores(monkeypatch) -> None:
    """The reference with each row's largest BF16 score q.k rounded the other way: what an
    honest kernel that sums q.k in another order gives where that score is a near tie (rare,
    ~28 outputs in 6.1M on an H200, but it is the case the bound must cover)."""
    real = attn._scores_probs

    def scores_probs(qh, k, mask, scale, dtype, round_scores=True, round_probs=True):
        if not round_scores:
            return real(qh, k, mask, scale, dtype, round_scores, round_probs)
        exact = torch.matmul(qh.double(), k.double())
        rn = exact.to(dtype)
        one = torch.ldexp(torch.ones_like(rn.float()), torch.frexp(rn.float())[1] - 8)
        up = (rn.float() + one).to(dtype)
        down = (rn.float() - one).to(dtype)
        other = torch.where(exact > rn.double(), up, down)
        top = (rn.float() + mask.float()).argmax(-1, keepdim=True)
        raw = rn.scatter(-1, top, other.gather(-1, top))
        probs = torch.softmax(raw * scale + mask, dim=-1, dtype=torch.float32)
        return probs.to(dtype) if round_probs else probs

    monkeypatch.setattr(attn, "_scores_probs", scores_probs)


def _peaky(args: tuple, factor: float) -> tuple:
    """Two channels of q scaled up, as the verifier's outlier cases do: rows where a few keys
    dominate the softmax."""
    q = args[0].clone()
    q[..., [3, 77]] *= factor
    return (q, *args[1:])


SHAPES = [
    {"T": 9, "seqs": 2, "S": 60, "Hq": 6, "Hkv": 1, "D": 128, "W": 0, "page": 4},
    {"T": 7, "seqs": 0, "S": 300, "Hq": 6, "Hkv": 2, "D": 128, "W": 16, "page": 4},
]


@pytest.mark.parametrize("shape", SHAPES, ids=["prefill", "decode-window"])
def test_attention_score_flips_fit_the_scale(monkeypatch, shape):
    c = contract("attention")
    worst_old = 0
    for seed in range(3):
        args = _peaky(c.make_inputs(shape, seed), 16.0)
        ref = c.reference(*args)
        scale = c.numerics.magnitude(*args)
        terms = attn._attention(args[0], args[1], args[2].abs(), *args[3:]).float()
        assert (scale >= terms).all()
        with monkeypatch.context() as m:
            _flipped_top_scores(m)
            other = c.reference(*args)
        assert (ulp_diff(other, ref) != 0).any()  # the orders do differ here
        assert ulp_diff_at(other, ref, scale).abs().max() <= c.numerics.max_ulp
        worst_old = max(worst_old, int(ulp_diff_at(other, ref, terms).abs().max()))
    # Without the flip term the same honest difference is out of bounds: the scale is needed.
    assert worst_old > c.numerics.max_ulp


def test_attention_scale_is_the_terms_on_plain_inputs():
    c = contract("attention")
    shape = {"T": 8, "seqs": 0, "S": 2048, "Hq": 6, "Hkv": 1, "D": 128, "W": 0, "page": 16}
    args = c.make_inputs(shape, 0)
    terms = attn._attention(args[0], args[1], args[2].abs(), *args[3:]).float()
    widened = (c.numerics.magnitude(*args) > terms).float().mean().item()
    assert widened < 0.05


def test_attention_wrong_answer_still_fails_where_widened():
    # Dropping each row's dominant key (what a kernel that loses a tile would do) on peaky rows.
    c = contract("attention")
    shape = SHAPES[0]
    args = _peaky(c.make_inputs(shape, 1), 16.0)
    ref = c.reference(*args)
    scale = c.numerics.magnitude(*args)
    q, k_cache, v_cache, table, base, seq, pos, window, sc = args
    wrong = []
    for t in range(q.shape[0]):
        row = int(seq[t])
        n = int(pos[t]) + 1 - int(base[row])
        j = torch.arange(n)
        slots = table[row][j // k_cache.shape[1]] * k_cache.shape[1] + j % k_cache.shape[1]
        k = k_cache.view(-1, *k_cache.shape[2:])[slots]
        v = v_cache.view(-1, *v_cache.shape[2:])[slots]
        kk = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        s = torch.einsum("hd,shd->hs", q[t].float(), kk.float())
        drop = s.argmax(-1)  # per head: its top key
        keep = torch.ones(q.shape[1], n, dtype=torch.bool)
        keep[torch.arange(q.shape[1]), drop] = False
        out = []
        for h in range(q.shape[1]):
            o = attn.eager_attention(q[t:t + 1, h:h + 1], k[keep[h]][:, [h // (q.shape[1] //
                                     k.shape[1])]], v[keep[h]][:, [h // (q.shape[1] //
                                     k.shape[1])]], pos[t:t + 1], j[keep[h]] + base[row],
                                     window, sc)
            out.append(o)
        wrong.append(torch.cat(out, dim=1))
    wrong = torch.cat(wrong)
    assert ulp_diff_at(wrong, ref, scale).abs().max() > 4 * c.numerics.max_ulp


def _flipped_branch_norm(branch, residual, post_weight, next_weight, add_index, eps):
    """norm_residual_norm with the normed branch p one BF16 ulp off where the residual add
    cancels most (the 1% of elements with the smallest sum against its terms): what an honest
    kernel whose RMS, summed in another order, rounds the other way gives at an element near a
    rounding tie, at the elements where that shows most."""
    a, b = nrn.residual_scales(add_index)
    p = rmsnorm(branch, post_weight, eps)
    terms = torch.maximum((p * a).float().abs(), (residual * b).float().abs())
    cancel = nrn.depth_scaled_add(p, residual, add_index).float().abs() / terms.clamp_min(1e-30)
    worst = cancel <= cancel.flatten().kthvalue(max(1, cancel.numel() // 100)).values
    one = torch.ldexp(torch.ones_like(p.float()), torch.frexp(p.float())[1] - 8)
    p = torch.where(worst, (p.float() + one).to(p.dtype), p)
    h = nrn.depth_scaled_add(p, residual, add_index)
    return rmsnorm(h, next_weight, eps), h


@pytest.mark.parametrize("op", ["norm_residual_norm", "allreduce_norm_residual_norm"])
def test_norm_boundary_cancellation_fits_the_scale(op):
    c = contract(op)
    shape = {"T": 512, "H": 640} if op == "norm_residual_norm" else {"R": 4, "T": 512, "H": 640}
    worst_raw = 0
    for seed in range(3):
        args = c.make_inputs(shape, seed)
        ref = c.reference(*args)
        scales = c.numerics.magnitude(*args)
        branch = args[0] if op == "norm_residual_norm" else \
            __import__("model.ops.allreduce_norm_residual_norm", fromlist=["x"]).rank_sum(args[0])
        other = _flipped_branch_norm(branch, *args[1:])
        for o, r, m in zip(other, ref, scales, strict=True):
            d = ulp_diff_at(o, r, m).abs()
            assert d.max() <= c.numerics.max_ulp
            worst_raw = max(worst_raw, int(ulp_diff(o, r).abs().max()))
    # Counted in the outputs' own ulps, the cancelled sums are far off: the scale is needed.
    assert worst_raw > c.numerics.max_ulp


def test_norm_boundary_scale_is_the_terms():
    c = contract("norm_residual_norm")
    args = c.make_inputs({"T": 64, "H": 320}, 0)
    branch, residual, post_w, next_w, add_index, eps = args
    a, b = nrn.residual_scales(add_index)
    p = rmsnorm(branch, post_w, eps)
    m_next, m_res = c.numerics.magnitude(*args)
    want = torch.maximum((p * a).float().abs(), (residual * b).float().abs())
    assert torch.equal(m_res, want)
    normed, new_res = c.reference(*args)
    # Where little cancels (the sum at least half its larger term, at most twice it) the scale
    # of normed_next is 1 to 4 times its own size (twice the terms', within the roundings).
    plain = (new_res.float().abs() > 0.5 * want) & (normed != 0)
    ratio = m_next[plain] / normed.float().abs()[plain]
    assert plain.float().mean() > 0.5
    assert ratio.min() > 0.95 and ratio.max() < 4.1


def test_the_reference_row_sum_of_bf16_squares_is_biased_low():
    """Why the RMS ops skip the bias test (`BIASED_ROW_SUMS`): summed in one long FP32 run, the
    squares of BF16 values (scale 3, H = 5120) come out below their exact sum in almost every
    row, a pairwise (tree) sum far less often: how far a sum is biased depends on its order, so
    two honest orders differ one way."""
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(256, 5120, generator=g)).to(BF16).float()
    sq = x * x  # exact in FP32
    exact = sq.double().sum(-1)
    run = torch.zeros(sq.shape[0])
    for j in range(sq.shape[1]):  # sequential FP32 adds, left to right
        run = run + sq[:, j]
    run = run.double()
    tree = torch.nn.functional.pad(sq, (0, 8192 - 5120))  # zeros: a power of two wide
    while tree.shape[-1] > 1:
        tree = tree[:, 0::2] + tree[:, 1::2]
    low_run = (run < exact).float().mean().item()
    low_tree = (tree[:, 0].double() < exact).float().mean().item()
    assert low_run > 0.9 and low_tree < 0.75


@pytest.mark.parametrize("op,judged", [("rmsnorm", False), ("norm_residual_norm", False),
                                       ("allreduce_norm_residual_norm", False),
                                       ("attention", True), ("moe_experts", True),
                                       ("qk_norm_rope", True)])
def test_which_ops_judge_the_sign_of_their_errors(op, judged):
    from autoopt.eval.numerics import effective_policy

    policy = effective_policy(contract(op).numerics, BF16, "cuda")
    assert policy.judge_bias is judged
    if not judged:
        assert contract(op).numerics.max_mismatch_fraction <= 1e-3
        assert "no bias test" in policy.describe()


def test_attention_scale_in_row_blocks_is_the_same_math():
    # The scale's pass runs 256 query rows at a time (a prefill chunk's [Hq, T, S] softmax
    # must not sit twice in memory beside the reference's): the same values, up to GEMM order.
    c = contract("attention")
    shape = {"T": 600, "seqs": 1, "S": 700, "Hq": 2, "Hkv": 1, "D": 128, "W": 0, "page": 16}
    args = _peaky(c.make_inputs(shape, 0), 8.0)
    blocked = c.numerics.magnitude(*args)
    whole = attn._attention(*args, error_scale=True)
    assert blocked.shape == whole.shape == args[0].shape
    assert torch.allclose(blocked, whole, rtol=2**-7, atol=0)


def test_attention_sparse_shortcut_still_fails_with_the_scale(monkeypatch):
    # A faster wrong kernel: keys below 1% of their row's largest probability dropped (sparse
    # attention). The scale widens the peaky rows' bound, but every output it moves is a
    # mismatch, and the policy's mismatch fraction rejects it.
    from autoopt.eval.numerics import OutputStats, effective_policy, judge

    c = contract("attention")
    shape = {"T": 24, "seqs": 2, "S": 300, "Hq": 6, "Hkv": 1, "D": 128, "W": 0, "page": 16}
    args = _peaky(c.make_inputs(shape, 2), 16.0)
    ref = c.reference(*args)
    real = attn._scores_probs

    def sparse(qh, k, mask, scale, dtype, round_scores=True, round_probs=True):
        probs = real(qh, k, mask, scale, dtype, round_scores, False)
        probs = torch.where(probs < 0.01 * probs.amax(-1, keepdim=True), 0.0, probs)
        probs = probs / probs.sum(-1, keepdim=True)
        return probs.to(dtype) if round_probs else probs

    with monkeypatch.context() as m:
        m.setattr(attn, "_scores_probs", sparse)
        wrong = c.reference(*args)
    stats = OutputStats()
    stats.add(wrong, ref, magnitude=c.numerics.magnitude(*args))
    reasons = judge(effective_policy(c.numerics, BF16, "cuda"), stats, "output 0")
    assert any("mismatch fraction" in r for r in reasons), reasons


@pytest.mark.parametrize("t", [1, 8, 32, 128])
def test_moe_cost_charges_the_experts_its_inputs_hit(t):
    # The op's floor reads the experts the test inputs' routing hits, on average: a floor above
    # what they hit makes an honest kernel "faster than the floor" (on the H200 at T = 32 the
    # old min(E, T*k) = 256 experts was 597 us against a kernel's 477).
    from model.ops import moe_experts as moe

    hit = [len(torch.unique(moe.make_inputs({"T": t, "H": 8, "E": 256, "I": 4, "k": 8}, s)[4]))
           for s in range(30)]
    expected = moe.expected_touched(t, 256, 8)
    assert sum(hit) / len(hit) == pytest.approx(expected, rel=0.03)
    cost = moe.cost({"T": t, "H": 5120, "E": 256, "I": 320, "k": 8})
    per_expert = 2 * 3 * 320 * 5120
    activations = 2 * 2 * t * 5120 + 12 * t * 8  # x in, out back, ids and weights
    assert (cost.bytes - activations) / per_expert == pytest.approx(min(256, t * 8, expected))
    counted = moe.cost({"T": t, "H": 5120, "E": 256, "I": 320, "k": 8, "touched": 3})
    assert counted.bytes < 4 * per_expert
