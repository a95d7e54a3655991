"""Every reference op against an independent formulation, and every near miss against the op.

The independent formulations compute in FP64 and round to BF16 at the points docs/numerics.md names.
FP64 and FP32 intermediates agree except where an FP32 result sits on a BF16 rounding boundary,
so the comparison allows 1 BF16 ulp on a small fraction of elements; anything structural (a
missing rounding point, a wrong scale, a wrong order) shows up as far more mismatches.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from autoopt.eval.numerics import ulp_diff_at
from model.config import preset
from model.ops import CONTRACTS, OP_NAMES

from ._hf import bf16_ulp

CFG = preset("tiny").replace(
    hidden_size=320,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=192,
    moe_intermediate_size=48,
)
TOKENS = [1, 17, 123]
BF = torch.bfloat16


def _close_bf16(got, want, frac=2e-3, atol=0.0, far_frac=0.0):
    assert got.dtype == want.dtype and got.shape == want.shape
    # Values that cancel to near zero count many ulps for a tiny absolute error: `atol` lets
    # such elements pass on absolute error alone. `far_frac`: the share of elements that may be
    # more than 1 ulp off (see test_moe_experts).
    ulp = bf16_ulp(got, want) * ((got.float() - want.float()).abs() > atol)
    far = (ulp > 1).float().mean()
    assert int(ulp.max()) <= 1 or (far_frac and far <= far_frac), (
        f"max ulp {int(ulp.max())} on {int((ulp > 1).sum())} of {ulp.numel()}")
    assert (ulp > 0).float().mean() <= frac, f"{int((ulp > 0).sum())} of {ulp.numel()} differ"


def _rms64(x, w, eps):
    x = x.double()
    return (w.double() * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(BF)


def _inputs(op, t, seed):
    c = CONTRACTS[op]
    return c.make_inputs(c.shapes_for(CFG, t), seed)


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("seed", [0, 1])
def test_rmsnorm(t, seed):
    x, w, eps = _inputs("rmsnorm", t, seed)
    _close_bf16(CONTRACTS["rmsnorm"].reference(x, w, eps), _rms64(x, w, eps))


@pytest.mark.parametrize("t", TOKENS)
def test_norm_residual_norm(t):
    branch, res, pw, nw, d, eps = _inputs("norm_residual_norm", t, 3)
    n, h = CONTRACTS["norm_residual_norm"].reference(branch, res, pw, nw, d, eps)
    p = _rms64(branch, pw, eps)
    a, b = 1 / math.sqrt(d), math.sqrt((d - 1) / d)
    want_h = ((p.double() * a).to(BF).double() + (res.double() * b).to(BF).double()).to(BF)
    _close_bf16(h, want_h)
    _close_bf16(n, _rms64(h, nw, eps))


@pytest.mark.parametrize("t", TOKENS)
def test_attn_output_gate(t):
    attn, gate, bias = _inputs("attn_output_gate", t, 4)
    g2 = (gate.double() + bias.double()[None, :, None]).to(BF)
    s = torch.sigmoid(g2.double()).to(BF)
    _close_bf16(
        CONTRACTS["attn_output_gate"].reference(attn, gate, bias),
        (attn.double() * s.double()).to(BF),
    )


@pytest.mark.parametrize("t", TOKENS)
def test_swiglu(t):
    gate, up = _inputs("swiglu", t, 5)
    g = gate.double()
    _close_bf16(
        CONTRACTS["swiglu"].reference(gate, up), (g * torch.sigmoid(g) * up.double()).to(BF)
    )


@pytest.mark.parametrize("t", TOKENS)
def test_logit_softcap(t):
    z, cap = _inputs("logit_softcap", t, 6)
    got = CONTRACTS["logit_softcap"].reference(z, cap)
    assert got.dtype == torch.float32
    want = torch.tanh(z.double() / cap) * cap
    # FP32 output: a few FP32 ulps from the FP64 value (tanh, divide, multiply each round).
    assert ((got.double() - want).abs() <= 4 * torch.finfo(torch.float32).eps * cap).all()


def _check_cache_write(k_cache, v_cache, before, slots, want_k, v):
    """The written slots hold want_k (within the op's ulp) and v (bits); the rest is untouched."""
    flat_k, flat_v = k_cache.flatten(0, 1), v_cache.flatten(0, 1)
    _close_bf16(flat_k[slots], want_k)
    assert torch.equal(flat_v[slots], v)
    keep = torch.ones(flat_k.shape[0], dtype=torch.bool)
    keep[slots] = False
    assert torch.equal(flat_k[keep], before[0].flatten(0, 1)[keep])
    assert torch.equal(flat_v[keep], before[1].flatten(0, 1)[keep])


@pytest.mark.parametrize("t", TOKENS)
def test_qk_norm_rope(t):
    q, k, v, qw, kw, cos, sin, eps, kc, vc, slots = _inputs("qk_norm_rope", t, 7)
    before = (kc.clone(), vc.clone())
    got_q, got_kc, got_vc = CONTRACTS["qk_norm_rope"].reference(q, k, v, qw, kw, cos, sin, eps,
                                                                kc, vc, slots)
    assert got_kc is kc and got_vc is vc  # updated in place

    def rope64(x, w):
        n = _rms64(x, w, eps).double()
        half = n.shape[-1] // 2
        rot = torch.cat((-n[..., half:], n[..., :half]), -1)
        return (n * cos.double()[:, None] + rot * sin.double()[:, None]).to(BF)

    _close_bf16(got_q, rope64(q, qw))
    _check_cache_write(kc, vc, before, slots, rope64(k, kw), v)


@pytest.mark.parametrize("t", TOKENS)
def test_qk_norm_ssmax(t):
    q, k, v, qw, kw, pos, eps, kc, vc, slots = _inputs("qk_norm_ssmax", t, 8)
    before = (kc.clone(), vc.clone())
    got_q, _, _ = CONTRACTS["qk_norm_ssmax"].reference(q, k, v, qw, kw, pos, eps, kc, vc, slots)
    tau = (1 + (pos.double() + 1) / 2048) ** 0.1
    _close_bf16(got_q, (_rms64(q, qw, eps).double() * tau[:, None, None]).to(BF))
    _check_cache_write(kc, vc, before, slots, _rms64(k, kw, eps), v)


@pytest.mark.parametrize("t,b,s,w", [(1, 1, 37, 0), (17, 1, 17, 0), (5, 5, 40, 16),
                                     (123, 3, 123, 16), (9, 9, 60, 0)])
def test_attention(t, b, s, w):
    c = CONTRACTS["attention"]
    shape = {**c.shapes_for(CFG, t, context=s, seqs=b), "W": w, "page": 4}
    q, kc, vc, table, base, q_seq, q_pos, window, scale = c.make_inputs(shape, 9)
    got = c.reference(q, kc, vc, table, base, q_seq, q_pos, window, scale)
    rep = q.shape[1] // kc.shape[2]
    page = kc.shape[1]
    want = torch.empty_like(got)
    for i in range(t):  # query by query, keys looked up through the page table
        row, p = int(q_seq[i]), int(q_pos[i])
        lo = max(int(base[row]), p - window + 1) if window else int(base[row])
        j = torch.arange(lo, p + 1) - int(base[row])
        slots = table[row][j // page] * page + j % page
        kk = kc.flatten(0, 1)[slots].double().repeat_interleave(rep, 1)  # [S, Hq, D]
        vv = vc.flatten(0, 1)[slots].double().repeat_interleave(rep, 1)
        # Eager rounding points: BF16 scores, BF16 scaled scores, BF16 probabilities.
        scores = torch.einsum("hd,shd->hs", q[i].double(), kk).to(BF).double()
        probs = torch.softmax((scores * scale).to(BF).double(), -1).to(BF).double()
        want[i] = torch.einsum("hs,shd->hd", probs, vv).to(BF)
    # Rounded probabilities feed a second GEMM: allow 1 ulp on up to 2% (FP32 vs FP64 sums).
    _close_bf16(got, want, frac=0.02)


@pytest.mark.parametrize("t", TOKENS)
def test_router(t):
    c = CONTRACTS["router"]
    x, w, b, ng, tg, k = c.make_inputs(c.shapes_for(CFG, t), 10)
    weights, ids = c.reference(x, w, b, ng, tg, k)
    s = torch.sigmoid(x.double() @ w.double().T)
    choice = s + b.double()
    per_group = choice.view(t, ng, -1)
    group_score = per_group.sort(-1, descending=True)[0][..., :2].sum(-1)
    keep = group_score.argsort(-1, descending=True)[:, :tg]
    for row in range(t):
        allowed = torch.cat(
            [
                torch.arange(g * (w.shape[0] // ng), (g + 1) * (w.shape[0] // ng))
                for g in keep[row].tolist()
            ]
        )
        best = allowed[choice[row, allowed].argsort(descending=True)[:k]]
        assert ids[row].tolist() == best.tolist()
        ww = s[row, best] / s[row, best].sum()
        assert torch.allclose(weights[row].double(), ww, rtol=1e-6, atol=0)


@pytest.mark.parametrize("t", TOKENS)
def test_moe_experts(t):
    c = CONTRACTS["moe_experts"]
    x, gu, down, w, ids, scale = c.make_inputs(c.shapes_for(CFG, t), 11)
    got = c.reference(x, gu, down, w, ids, scale)
    inter = gu.shape[1] // 2
    want = torch.empty_like(got)
    for row in range(t):
        acc = torch.zeros(x.shape[1], dtype=torch.float64)
        for slot, e in enumerate(ids[row].tolist()):
            h = (gu[e].double() @ x[row].double()).to(BF).double()
            a = (F.silu(h[:inter]) * h[inter:]).to(BF).double()
            d = (down[e].double() @ a).to(BF).double()
            acc += d * w[row, slot].double()
        want[row] = (acc.to(BF).double() * scale).to(BF)
    # The FP32 combine and GEMM accumulators against FP64: a flipped gu or d_k rounding moves an
    # output by at most one ulp of y at the scale of the combined terms (two after the x 2.5
    # rounding), however near zero the sum cancels; a few percent of outputs at most.
    mag = c.numerics.magnitude(x, gu, down, w, ids, scale)
    d = ulp_diff_at(got, want, mag).abs()
    assert int(d.max()) <= 2 and float((d > 0).float().mean()) <= 0.03, (int(d.max()),
                                                                          int((d > 0).sum()))


@pytest.mark.parametrize("t", [1, 17])
def test_qkv_gate_proj(t):
    c = CONTRACTS["qkv_gate_proj"]
    x, w, hq, hkv = c.make_inputs(c.shapes_for(CFG, t), 12)
    q, k, v, g = c.reference(x, w, hq, hkv)
    full = (x.double() @ w.double().T).to(BF)
    d = CFG.head_dim
    parts = full.split([hq * d, hkv * d, hkv * d, hq * d], -1)
    for got, want in zip((q, k, v, g), parts):
        _close_bf16(got.reshape(t, -1), want, frac=0.02)


def _differ(a, b) -> int:
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    return sum(int((x != y).sum()) for x, y in zip(a, b))


@pytest.mark.parametrize("t", TOKENS)
def test_gated_o_proj(t):
    c = CONTRACTS["gated_o_proj"]
    attn, gate, bias, w = c.make_inputs(c.shapes_for(CFG, t), 14)
    g2 = (gate.double() + bias.double()[None, :, None]).to(BF)
    a = (attn.double() * torch.sigmoid(g2.double()).to(BF).double()).to(BF)
    want = (a.reshape(t, -1).double() @ w.double().T).to(BF)
    _close_bf16(c.reference(attn, gate, bias, w), want, frac=0.02)


def test_composite_op_is_composed_from_the_tables_parts():
    from model.ops import OpTable

    c = CONTRACTS["gated_o_proj"]
    args = c.make_inputs(c.shapes_for(CFG, 5), 3)
    # With every op at its reference the composition is the contract's reference, bitwise.
    assert torch.equal(OpTable().gated_o_proj(*args), c.reference(*args))
    calls = []

    def gate(attn, g, bias):  # a stand-in for a selected gate kernel
        calls.append(attn.shape)
        return CONTRACTS["attn_output_gate"].reference(attn, g, bias) * 2

    table = OpTable({"attn_output_gate": gate}, {"attn_output_gate": "mine"})
    got = table.gated_o_proj(*args)
    assert calls and table.sources["gated_o_proj"] == "reference"
    assert torch.equal(got, F.linear((CONTRACTS["attn_output_gate"].reference(*args[:3]) * 2)
                                     .reshape(5, -1), args[3]))
    # A table copied from another (as the profiler and the runtime build them) composes the
    # composite again from its own parts, not the other table's.
    copied = OpTable({n: table.impl(n) for n in table.sources if n != "attn_output_gate"})
    calls.clear()
    assert torch.equal(copied.gated_o_proj(*args), c.reference(*args)) and not calls
    # A variant of the composite itself runs as given, whatever the parts are.
    fused = OpTable({"gated_o_proj": lambda *a: torch.zeros(5, CFG.hidden_size, dtype=BF),
                     "attn_output_gate": gate}, {"gated_o_proj": "v1"})
    calls.clear()
    assert fused.gated_o_proj(*args).abs().sum() == 0 and not calls


@pytest.mark.parametrize("op", OP_NAMES)
def test_every_near_miss_differs_from_the_reference(op):
    c = CONTRACTS[op]
    # Enough elements that a summation-order near miss crosses a BF16 rounding boundary
    # (it does so for ~5e-5 of outputs).
    shape = c.shapes_for(CFG, 257)
    args = c.make_inputs(shape, 13)

    def fresh():  # ops may write inputs in place (the KV cache): each call gets its own copy
        return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]

    ref = c.reference(*fresh())
    for name, near in c.numerics.near_misses.items():
        assert _differ(near(*fresh()), ref) > 0, f"near miss {name} of {op} equals the reference"


def test_every_op_declares_its_contract():
    for op in OP_NAMES:
        c = CONTRACTS[op]
        shape = c.shapes_for(CFG, 5)
        cost = c.cost(shape)
        assert cost.bytes > 0 and cost.flops >= 0
        assert c.signature.startswith(op + "(")
        assert set(c.axes) and c.numerics.kind in ("bitwise", "ulp")


def test_ssmax_positions_let_the_zero_based_near_miss_stand_out_of_libm_noise():
    # An honest exp/log1p may put tau one FP32 ulp off torch's; the zero-based position must
    # move far more BF16 outputs than that, or the judge cannot tell it from an honest kernel
    # (at positions near 1M the two are the same size).
    from model.ops import qk_norm_ssmax as op
    from model.ops.rmsnorm import reference as rmsnorm

    shape = {"T": 17, "Hq": 6, "Hkv": 1, "D": 128, "page": 16}
    near_total = noise_total = 0
    for seed in range(24):
        q, k, _, qw, kw, pos, eps = op.make_inputs(shape, seed)[:7]
        ref, _ = op.norm_ssmax(q, k, qw, kw, pos, eps)
        near, _ = op.norm_ssmax(q, k, qw, kw, pos - 1, eps)
        tau = op.ssmax_scale(pos)
        for step in (-1.0, 2.0):
            off = torch.nextafter(tau, torch.full_like(tau, step))
            noisy = (rmsnorm(q, qw, eps).float() * off[:, None, None]).to(q.dtype)
            noise_total += int((noisy != ref).sum())
        near_total += int((near != ref).sum())
    assert near_total >= 20 * max(noise_total, 1), (near_total, noise_total)


def test_edge_shapes_cover_every_depth_and_expert_parallel_ranks():
    nrn = CONTRACTS["norm_residual_norm"].tests.edge_cases({"T": 4, "H": 64})
    depths = sorted(e.shape["add_index"] for e in nrn if "add_index" in e.shape)
    assert depths == list(range(2, 106)) and all(
        e.shape["T"] == 1 for e in nrn if "add_index" in e.shape)
    args = CONTRACTS["norm_residual_norm"].make_inputs(
        next(e.shape for e in nrn if e.name == "add_index=105"), 0)
    assert args[4] == 105
    moe = CONTRACTS["moe_experts"]
    edges = {e.name: e.shape for e in moe.tests.edge_cases(moe.shapes_for(CFG, 3))}
    assert {edges["expert_parallel_2"]["ep"], edges["expert_parallel_8"]["ep"]} == {2, 8}
    e_local = edges["expert_parallel_8"]["E"]
    offsets, outside = set(), 0
    for seed in range(8):
        x, gu, down, w, ids, scale, offset = moe.make_inputs(edges["expert_parallel_8"], seed)
        # Never rank 0: with a zero offset a kernel that ignores the offset is exact.
        assert offset % e_local == 0 and 0 < offset < 8 * e_local
        assert int(ids.max()) < 8 * e_local
        outside += int(((ids < offset) | (ids >= offset + e_local)).sum())
        offsets.add(offset)
        # The reference's slots of other ranks' experts contribute nothing.
        alone = moe.reference(x, gu, down, w.masked_fill((ids < offset) |
                              (ids >= offset + e_local), 0.0), ids, scale, offset)
        assert torch.equal(alone, moe.reference(x, gu, down, w, ids, scale, offset))
    assert len(offsets) > 1 and outside > 0
    two = edges["expert_parallel_2"]
    assert {moe.make_inputs(two, seed)[-1] for seed in range(16)} == {two["E"]}
    # Without `ep` the inputs are the single-rank ones, as before.
    assert len(moe.make_inputs(moe.shapes_for(CFG, 3), 0)) == 6
