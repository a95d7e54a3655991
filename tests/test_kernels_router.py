"""router triton_v1 to triton_v5 against the router reference: ids exactly (modulo
FP32 ties), weights within the op's policy, at the real width (H=5120, E=256, 8 groups, top-4
groups, top-8) and smaller.

On CPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py). The policy is judged with the
harness's own code (autoopt.eval.numerics), so these tests and `autoopt verify` agree.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from autoopt.eval.numerics import OutputStats, effective_policy, judge, router_tie_rows
from model.ops import CONTRACTS
from model.registry import Registry

ROOT = Path(__file__).resolve().parents[1]
C = CONTRACTS["router"]
REAL = {"H": 5120, "E": 256, "n_group": 8, "topk_group": 4, "top_k": 8}


VARIANTS = ["triton_v1", "triton_v2", "triton_v3", "triton_v4", "triton_v5", "triton_v6"]


@pytest.fixture(scope="module", params=VARIANTS)
def mod(request):
    """Each hand-written variant in turn (the tests that hold for any router kernel)."""
    return Registry().load_variant("router", request.param)


@pytest.fixture(scope="module")
def v1():
    return Registry().load_variant("router", "triton_v1")


@pytest.fixture(scope="module")
def v2():
    return Registry().load_variant("router", "triton_v2")


@pytest.fixture(scope="module")
def v3():
    return Registry().load_variant("router", "triton_v3")


@pytest.fixture(scope="module")
def v4():
    return Registry().load_variant("router", "triton_v4")


@pytest.fixture(scope="module")
def v5():
    return Registry().load_variant("router", "triton_v5")


@pytest.fixture(scope="module")
def v6():
    return Registry().load_variant("router", "triton_v6")


def check(args: tuple, got: tuple, ref: tuple | None = None) -> list[dict]:
    """Assert the router policy; return the tolerated tie rows."""
    ref = ref or C.reference(*args)
    (w, ids), (rw, rids) = got, ref
    assert w.shape == rw.shape and w.dtype == torch.float32
    assert ids.shape == rids.shape and ids.dtype == torch.int64
    cpu_args = tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)
    ok, rows = router_tie_rows(cpu_args, rids.cpu(), ids.cpu())
    bad = [r for r in rows if not r["tie"]]
    assert not bad, f"ids differ without an FP32 tie: {bad[:3]}"
    keep = (~ok)[:, None].expand_as(rids)
    stats = OutputStats()
    stats.add(w.cpu(), rw.cpu(), keep.cpu())
    policy = effective_policy(C.numerics, torch.float32, str(w.device))
    reasons = judge(policy, stats, "weights")
    assert not reasons, reasons
    return [r for r in rows if r["tie"]]


@pytest.mark.parametrize("t,seed", [(1, 0), (1, 1), (5, 0), (5, 2), (17, 0), (17, 1),
                                    pytest.param(64, 0, marks=pytest.mark.slow)])
def test_real_width_matches_reference(mod, t, seed):
    args = C.make_inputs({"T": t, **REAL}, seed)
    check(args, mod.run(*args))


def _configs(mod) -> list[dict]:
    space = mod.CONFIG_SPACE
    # A spread of the tuner's space: fused and not, split-K from none to many, wide and narrow
    # FMA tiles, the library GEMM.
    picks = [{}, {"FUSE": 0}, {"FUSE": 1, "SPLIT_K": 40, "BLOCK_K": 32, "BLOCK_E": 8},
             {"SPLIT_K": 1, "BLOCK_T": 16, "BLOCK_E": 32, "BLOCK_K": 64, "FUSE": 0},
             {"SPLIT_K": 5, "BLOCK_T": 4, "SEL_T": 4, "FUSE": 0, "num_warps": 2},
             {"FUSE": 1, "BLOCK_E": 2, "BLOCK_K": 512, "SPLIT_K": 4, "SEL_T": 8},
             {"LIB_GEMM": 1, "SEL_T": 8, "SEL_WARPS": 4}]
    for p in picks:
        assert all(v in space[k] for k, v in p.items()), p
    return picks


@pytest.mark.parametrize("t", [1, 6, pytest.param(17, marks=pytest.mark.slow)])
def test_every_config_is_the_same_function(v1, t):
    args = C.make_inputs({"T": t, "H": 320, "E": 256}, 3)
    ref = C.reference(*args)
    for cfg in _configs(v1):
        check(args, v1.run(*args, config=cfg), ref)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [{}, {"LIB_GEMM": 0, "BLOCK_T": 16, "BLOCK_E": 32,
                                      "SPLIT_K": 2, "SEL_T": 8}])
def test_prefill_2048_tokens(v1, cfg):
    # T=2048 takes the prefill path: the library GEMM (default) or the FMA tiles; every row is
    # checked (narrow H keeps the interpreter affordable; the real width is checked below).
    args = C.make_inputs({"T": 2048, "H": 48, "E": 256}, 11)
    check(args, v1.run(*args, config={"SEL_T": 8, "SEL_WARPS": 4, **cfg}))


@pytest.mark.slow
def test_prefill_2048_tokens_at_real_width(mod):
    # The default prefill path at the real width: its logits are the reference's own GEMM, so
    # the ids are identical (not merely equal modulo ties).
    # triton_v5's default there is its own (exact-product) GEMM: equal modulo FP32 ties.
    args = C.make_inputs({"T": 2048, **REAL}, 12)
    w, ids = mod.run(*args, config={"SEL_T": 8, "SEL_WARPS": 4})
    rw, rids = C.reference(*args)
    if "bf16x3" not in getattr(mod, "CONFIG_SPACE", {}).get("GEMM", []):
        assert torch.equal(ids, rids)
    check(args, (w, ids), (rw, rids))


def test_prefill_tiles_at_real_width_few_rows(v1):
    # The FMA tiles (no tl.dot) over the full H=5120 reduction, on a few tokens.
    args = C.make_inputs({"T": 19, **REAL}, 13)
    check(args, v1.run(*args, config={"LIB_GEMM": 0, "BLOCK_T": 16, "BLOCK_E": 32,
                                       "BLOCK_K": 512, "SPLIT_K": 1, "SEL_T": 8}))


def test_fused_and_two_kernel_paths_agree_bitwise(v1):
    args = C.make_inputs({"T": 7, "H": 640, "E": 256}, 4)
    base = {"BLOCK_T": 8, "BLOCK_E": 16, "BLOCK_K": 64, "SPLIT_K": 5, "SEL_T": 8}
    w1, i1 = v1.run(*args, config={**base, "FUSE": 1})
    w0, i0 = v1.run(*args, config={**base, "FUSE": 0})
    assert torch.equal(i1, i0) and torch.equal(w1.view(torch.int32), w0.view(torch.int32))
    # The fused path's counter is re-armed: a second call computes the same again.
    w2, i2 = v1.run(*args, config={**base, "FUSE": 1})
    assert torch.equal(i2, i1) and torch.equal(w2.view(torch.int32), w1.view(torch.int32))


def _tied_inputs(t: int, seed: int):
    """Experts 5 and 6 (group 0) and 40 and 41 (group 1) with identical weight rows and biases,
    pushed to the top so the top-8 boundary and the group's top-2 both see exact ties; group 7
    is a copy of group 6, so the top-4 group boundary ties too."""
    h, w, b, ng, tg, k = C.make_inputs({"T": t, "H": 320, "E": 256}, seed)
    w, b = w.clone(), b.clone()
    for dst, src in ((6, 5), (41, 40)):
        w[dst], b[dst] = w[src], b[src]
    b[[5, 6, 40, 41]] += 0.3
    w[224:256], b[224:256] = w[192:224], b[192:224]
    return h, w, b, ng, tg, k


@pytest.mark.parametrize("seed,t", [(0, 17), (1, 17), (2, 17), (0, 1), (1, 2), (2, 6), (0, 80)])
def test_constructed_ties(mod, seed, t):
    # T=1, 2 fused; 6 and 17 two kernels; 80 the library GEMM.
    args = _tied_inputs(t, seed)
    w, ids = mod.run(*args)
    check(args, (w, ids))
    # Tied experts come out lower id first, adjacent, with equal weights.
    for row in ids.tolist():
        for a, b in ((5, 6), (40, 41)):
            if a in row and b in row:
                assert row.index(b) == row.index(a) + 1
    tied = ids == 5
    if tied.any():
        r = tied.nonzero()[0, 0]
        got = w[r][ids[r] == 5], w[r][ids[r] == 6]
        assert torch.equal(*got) if got[1].numel() else True


@pytest.mark.parametrize("kind", ["one_group", "two_groups", "negative"])
def test_skewed_biases(mod, kind):
    # The selection at the real expert layout; a narrow hidden size keeps the interpreter's GEMV
    # short (the real width is test_real_width_matches_reference's).
    h, w, b, ng, tg, k = C.make_inputs({"T": 17, **REAL, "H": 320}, 5)
    b = b.clone()
    if kind == "one_group":  # every top-8 expert from group 3 (top-k inside one kept group)
        b[96:128] += 2.0
    elif kind == "two_groups":  # groups 0 and 7 always kept, the other two kept groups vary
        b[0:32] += 1.0
        b[224:256] += 1.0
    else:  # large negative biases: c below zero for most experts (the sign-aware key order)
        b -= 3.0
        b[::7] += 2.5
    args = (h, w, b, ng, tg, k)
    w_out, ids = mod.run(*args)
    check(args, (w_out, ids))
    if kind == "one_group":
        assert bool(((ids >= 96) & (ids < 128)).all())


def test_rows_sum_to_one_and_ids_are_distinct(mod):
    args = C.make_inputs({"T": 33, "H": 320, "E": 256}, 6)
    w, ids = mod.run(*args)
    assert torch.allclose(w.sum(-1), torch.ones(33), atol=1e-6)
    assert all(len(set(r)) == 8 for r in ids.tolist())


def test_empty_batch(mod):
    h, w, b, ng, tg, k = C.make_inputs({"T": 1, "H": 320, "E": 256}, 0)
    out_w, out_i = mod.run(h[:0], w, b, ng, tg, k)
    assert out_w.shape == (0, 8) and out_i.shape == (0, 8) and out_i.dtype == torch.int64


@pytest.mark.parametrize("bad,match", [
    ("bf16_weight", "fp32 weight"), ("short_bias", "bias"), ("top_k_6", "power-of-2 top_k"),
    ("groups_3", "groups"), ("strided_h", "unit stride"),
])
def test_bad_input_raises_a_clear_error(mod, bad, match):
    h, w, b, ng, tg, k = C.make_inputs({"T": 3, "H": 320, "E": 256}, 0)
    if bad == "bf16_weight":
        w = w.bfloat16()
    elif bad == "short_bias":
        b = b[:100]
    elif bad == "top_k_6":
        k = 6
    elif bad == "groups_3":
        ng = 3
    else:
        h = torch.cat([h, h], dim=1)[:, ::2]
    with pytest.raises(ValueError, match=match):
        mod.run(h, w, b, ng, tg, k)


@pytest.mark.parametrize("scale", ["tiny", "huge"])
def test_saturated_and_flat_sigmoids(mod, scale):
    # Tiny h puts every s at 0.5 (selection by the bias alone, every weight tied); huge h
    # saturates many s to exactly 0 or 1 (c ties wherever biases meet).
    h, w, b, ng, tg, k = C.make_inputs({"T": 5, **REAL}, 7)
    args = (h * (2.0**-20 if scale == "tiny" else 2.0**6), w, b, ng, tg, k)
    check(args, mod.run(*args))


# --- triton_v2's own paths ---------------------------------------------------------------------

def _v2_configs(v2) -> list[dict]:
    # Whole-expert programs from one expert to 32, unrolled K (<= 8 steps) and a K loop, one to
    # eight warps, token blocks of one to eight, the two-kernel path and the library GEMM.
    picks = [{}, {"FUSE": 0}, {"BLOCK_E": 1, "BLOCK_K": 128, "num_warps": 1},
             {"BLOCK_E": 32, "BLOCK_K": 64, "BLOCK_T": 4, "num_warps": 8},
             {"BLOCK_E": 4, "BLOCK_K": 512, "BLOCK_T": 8, "num_warps": 2},
             {"FUSE": 0, "BLOCK_T": 16, "SEL_WARPS": 1}, {"LIB_GEMM": 1, "SEL_WARPS": 8}]
    for p in picks:
        assert all(v in v2.CONFIG_SPACE[k] for k, v in p.items()), p
    return picks


@pytest.mark.parametrize("t", [1, 6, pytest.param(17, marks=pytest.mark.slow)])
def test_v2_every_config_is_the_same_function(v2, t):
    args = C.make_inputs({"T": t, "H": 640, "E": 256}, 3)  # BLOCK_K 64: a 10-step K loop
    ref = C.reference(*args)
    for cfg in _v2_configs(v2):
        check(args, v2.run(*args, config=cfg), ref)


def test_v2_fused_and_two_kernel_paths_agree_bitwise(v2):
    args = C.make_inputs({"T": 7, "H": 640, "E": 256}, 4)
    base = {"BLOCK_T": 2, "BLOCK_E": 4, "BLOCK_K": 128}  # four token blocks, four counters
    w1, i1 = v2.run(*args, config={**base, "FUSE": 1})
    w0, i0 = v2.run(*args, config={**base, "FUSE": 0})
    assert torch.equal(i1, i0) and torch.equal(w1.view(torch.int32), w0.view(torch.int32))
    # Every token block's counter is re-armed: later calls compute the same again.
    for _ in range(2):
        w2, i2 = v2.run(*args, config={**base, "FUSE": 1})
        assert torch.equal(i2, i1) and torch.equal(w2.view(torch.int32), w1.view(torch.int32))
    assert not v2._counter(torch.device("cpu")).any()


def test_v2_library_logits_give_the_reference_ids(v2):
    # Above 64 tokens (or with LIB_GEMM) the logits are the reference's own GEMM: the ids are
    # the reference's exactly, and the weights within the policy.
    args = C.make_inputs({"T": 70, "H": 320, "E": 256}, 9)
    w, ids = v2.run(*args)
    rw, rids = C.reference(*args)
    assert torch.equal(ids, rids)
    check(args, (w, ids), (rw, rids))


# --- triton_v3: triton_v1's GEMV, triton_v2's ranking, a selection program per token ---------

# GEMV tiles shared with triton_v1's two-kernel path: a one-step unrolled slice, a K loop, a
# split that leaves no empty slice, token blocks of one to sixteen.
_V3_SAME_AS_V1 = [
    {"BLOCK_T": 1, "BLOCK_E": 8, "BLOCK_K": 64, "SPLIT_K": 10, "num_warps": 1},
    {"BLOCK_T": 4, "BLOCK_E": 4, "BLOCK_K": 32, "SPLIT_K": 4, "num_warps": 2},
    {"BLOCK_T": 16, "BLOCK_E": 32, "BLOCK_K": 64, "SPLIT_K": 1, "num_warps": 4},
    {"BLOCK_T": 2, "BLOCK_E": 16, "BLOCK_K": 128, "SPLIT_K": 5, "num_warps": 2},
]


@pytest.mark.parametrize("t,seed", [(1, 0), (3, 1), (5, 2),
                                    pytest.param(17, 3, marks=pytest.mark.slow)])
def test_v3_is_bitwise_v1_with_the_same_gemv(v1, v3, t, seed):
    # Same GEMV order (split-K partials added in split order), an exact selection either way:
    # the outputs are triton_v1's bit for bit, whichever selection algorithm ran. 17 tokens
    # cross the widest token tile (16); the narrow tiles' boundaries are crossed below that.
    args = C.make_inputs({"T": t, "H": 640, "E": 256}, seed)
    for cfg in [c for c in _V3_SAME_AS_V1 if t <= 16 or c["BLOCK_T"] == 16]:
        for k, v in cfg.items():
            assert v in v3.CONFIG_SPACE[k] and v in v1.CONFIG_SPACE[k], (k, v)
        w1, i1 = v1.run(*args, config={**cfg, "FUSE": 0, "SEL_T": 1})
        for sel in ({"SEL": "rank", "SEL_WARPS": 2}, {"SEL": "rounds", "SEL_T": 2}):
            w3, i3 = v3.run(*args, config={**cfg, **sel})
            assert torch.equal(i3, i1), (cfg, sel)
            assert torch.equal(w3.view(torch.int32), w1.view(torch.int32)), (cfg, sel)


def test_v3_configs_stay_in_policy(v3):
    args = C.make_inputs({"T": 6, "H": 640, "E": 256}, 8)
    ref = C.reference(*args)
    for cfg in ({}, {"SEL_WARPS": 1}, {"SEL_WARPS": 8, "BLOCK_K": 512, "SPLIT_K": 2},
                {"SEL_WARPS": 16}, {"PDL": 0}, {"LIB_GEMM": 1},
                {"SPLIT_K": 40, "BLOCK_K": 32, "BLOCK_E": 2},
                {"SEL": "rounds", "SEL_T": 8, "SEL_WARPS": 2}, {"LIB_GEMM": 1, "SEL": "rounds"}):
        assert all(v in v3.CONFIG_SPACE[k] for k, v in cfg.items()), cfg
        check(args, v3.run(*args, config=cfg), ref)


def test_v3_default_buckets_follow_the_sweeps(v3):
    # T <= 16 the FMA GEMV (the T = 16 tiles beat cuBLAS in triton_v1's H200 sweep); from 17 on
    # a GPU the library GEMM; the CPU keeps the Triton GEMV up to 64 tokens. PDL only on a GPU
    # (`router_fwd` drops it elsewhere).
    assert v3.default_config(1)["SPLIT_K"] == 20 and not v3.default_config(16)["LIB_GEMM"]
    assert v3.default_config(17)["LIB_GEMM"] and not v3.default_config(64, on_gpu=False)["LIB_GEMM"]
    # The ranking where a call is a few tokens' latency, the rounds where it is many tokens'.
    assert v3.default_config(16)["SEL"] == "rank" and v3.default_config(17)["SEL"] == "rounds"
    for t in (1, 2, 4, 8, 16, 17, 64, 2048):
        cfg = v3.default_config(t)
        assert all(v in v3.CONFIG_SPACE[k] for k, v in cfg.items()), (t, cfg)


# --- triton_v4: triton_v3's GEMV, a bitonic top-k selection, FMA-dot tiles from 17 tokens ------

@pytest.mark.parametrize("t,seed", [(1, 0), (5, 2)])
def test_v4_is_bitwise_v3_with_the_same_gemv(v3, v4, t, seed):
    # Same GEMV (`GEMM = "fma"`), an exact selection either way: triton_v3's outputs bit for bit.
    args = C.make_inputs({"T": t, "H": 640, "E": 256}, seed)
    for cfg in _V3_SAME_AS_V1[:2] + _V3_SAME_AS_V1[3:]:
        w3, i3 = v3.run(*args, config={**cfg, "SEL": "rank", "LIB_GEMM": 0})
        for sel in ({"SEL": "topk", "SEL_WARPS": 8}, {"SEL": "topk", "SEL_WARPS": 1},
                    {"SEL": "rounds", "SEL_T": 2}):
            w4, i4 = v4.run(*args, config={**cfg, **sel, "GEMM": "fma"})
            assert torch.equal(i4, i3), (cfg, sel)
            assert torch.equal(w4.view(torch.int32), w3.view(torch.int32)), (cfg, sel)


def test_v4_configs_stay_in_policy(v4):
    # The dot tiles (16 to 64 a side, a K loop, split-K), both selections, warps, the library GEMM.
    args = C.make_inputs({"T": 21, "H": 640, "E": 256}, 8)
    ref = C.reference(*args)
    for cfg in ({}, {"GEMM": "dot", "BLOCK_T": 16, "BLOCK_E": 16, "BLOCK_K": 16, "SPLIT_K": 40},
                {"GEMM": "dot", "BLOCK_T": 64, "BLOCK_E": 64, "BLOCK_K": 128, "SPLIT_K": 1},
                {"GEMM": "dot", "BLOCK_T": 1, "BLOCK_E": 2, "SPLIT_K": 5, "SEL": "rounds",
                 "SEL_T": 8}, {"SEL_WARPS": 2}, {"SEL_WARPS": 16, "PDL": 0}, {"GEMM": "lib"},
                {"GEMM": "fma", "BLOCK_T": 8, "BLOCK_E": 16, "BLOCK_K": 128, "SPLIT_K": 4}):
        assert all(v in v4.CONFIG_SPACE[k] for k, v in cfg.items()), cfg
        check(args, v4.run(*args, config=cfg), ref)
    with pytest.raises(ValueError, match="GEMM must be one of"):
        v4.run(*args, config={"GEMM": "tf32"})


@pytest.mark.parametrize("e,ng,tg,k", [(16, 4, 2, 2), (64, 2, 1, 1), (64, 8, 4, 16),
                                       (128, 4, 3, 32), (8, 4, 4, 8)])
def test_v4_other_expert_layouts(v4, e, ng, tg, k):
    # Groups of 2 to 32, top-1 to top-32, a top-k wider than a group (every member a candidate),
    # every group kept; dot tiles wider than E (masked) and the FMA GEMV.
    args = C.make_inputs({"T": 5, "H": 96, "E": e, "n_group": ng, "topk_group": tg,
                          "top_k": k}, e + k)
    ref = C.reference(*args)
    for cfg in ({}, {"GEMM": "dot", "BLOCK_E": 32, "BLOCK_K": 32}):
        w, ids = v4.run(*args, config=cfg)
        check(args, (w, ids), ref)


def test_v4_default_buckets(v4):
    # The FMA GEMV to 16 tokens, the dot tiles to 64, the library GEMM above on a GPU: two
    # kernels to 64 tokens. The top-k selection to 64, the rounds above.
    assert [v4.default_config(t)["GEMM"] for t in (1, 2, 4, 8, 16, 17, 64, 65, 2048)] == \
        ["fma"] * 5 + ["dot"] * 2 + ["lib"] * 2
    assert v4.default_config(64)["SEL"] == "topk" and v4.default_config(65)["SEL"] == "rounds"
    for t in (1, 2, 4, 8, 16, 17, 32, 64, 2048):
        cfg = v4.default_config(t)
        assert all(v in v4.CONFIG_SPACE[k] for k, v in cfg.items()), (t, cfg)


# --- triton_v5: triton_v4 with the FP32 GEMM from 17 tokens as three exact BF16 products ----

_SPLIT3 = _v5_split3 = None


def _split3_kernel():
    # triton_v5's own `_split3`, each term stored: the property the GEMM's exactness rests on.
    global _SPLIT3, _v5_split3
    if _SPLIT3 is None:
        import triton
        import triton.language as tl

        _v5_split3 = Registry().load_variant("router", "triton_v5")._split3  # a global: jit

        @triton.jit
        def k(w_ptr, o_ptr, N: tl.constexpr):
            offs = tl.arange(0, N)
            w1, w2, w3 = _v5_split3(tl.load(w_ptr + offs))
            tl.store(o_ptr + offs, w1)
            tl.store(o_ptr + N + offs, w2)
            tl.store(o_ptr + 2 * N + offs, w3)

        _SPLIT3 = k
    return _SPLIT3


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_v5_split_terms_are_bf16_and_sum_to_the_weight(seed):
    # Random bit patterns over exponents 2**-100 to 2**100, both signs, plus values whose low
    # bits round BF16 up (the split truncates: no carry to lose) and exact BF16 values.
    g = torch.Generator().manual_seed(seed)
    n = 4096
    mant = torch.rand(n, generator=g, dtype=torch.float64) + 1.0
    exp = torch.randint(-100, 101, (n,), generator=g).double()
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    w = (sign * mant * torch.pow(2.0, exp)).float()
    w[:8] = torch.tensor([1.0, -0.0, 0.0, 3.0, 1 + 2**-8 + 2**-9, -(1 - 2**-24), 2**-23, 0.1])
    out = torch.empty(3 * n)
    _split3_kernel()[(1,)](w, out, N=n)
    terms = out.view(3, n)
    for t in terms:
        assert torch.equal(t.bfloat16().float(), t)  # each term a BF16 value
    assert torch.equal(terms.double().sum(0), w.double())  # and exactly the weight
    assert (terms[0].abs() >= terms[1].abs()).all() and (terms[1].abs() >= terms[2].abs()).all()


def _dyadic_inputs(t: int, h_dim: int, e: int, seed: int):
    # h of +-1 at 16 places a row, weights of 20 significant bits below 1/8 (multiples of
    # 2**-22): every product and every partial sum is such a multiple below 2, exact in FP32, so
    # each summation order gives the exact logits; one BF16 (or TF32) rounding of a weight does
    # not.
    g = torch.Generator().manual_seed(seed)
    h = torch.zeros(t, h_dim)
    for row in h:
        row[torch.randperm(h_dim, generator=g)[:16]] = 1.0
    h *= torch.where(torch.rand(t, h_dim, generator=g) < 0.5, -1.0, 1.0)
    w = (torch.randint(-2**19, 2**19, (e, h_dim), generator=g).double() * 2**-22).float()
    return h.to(torch.bfloat16), w


def _v5_logits(v5, h, w, cfg: dict, device="cpu") -> torch.Tensor:
    import triton

    t, hid = h.shape
    e = w.shape[0]
    bk = cfg["BLOCK_K"]
    split = min(cfg["SPLIT_K"], triton.cdiv(hid, bk))
    steps = triton.cdiv(triton.cdiv(hid, split), bk)
    split = triton.cdiv(hid, steps * bk)
    part = torch.full((split, t, e), float("nan"), device=device)
    grid = (triton.cdiv(e, cfg["BLOCK_E"]), split, triton.cdiv(t, cfg["BLOCK_T"]))
    v5._router_bf16x3_kernel[grid](h, w, part, t, hid, h.stride(0), w.stride(0), E=e,
                                   BLOCK_T=cfg["BLOCK_T"], BLOCK_E=cfg["BLOCK_E"], BLOCK_K=bk,
                                   K_STEPS=steps, ON_GPU=h.is_cuda, PDL=False,
                                   num_warps=cfg.get("num_warps", 4))
    return part.double().sum(0)


@pytest.mark.parametrize("cfg", [
    {"BLOCK_T": 16, "BLOCK_E": 16, "BLOCK_K": 64, "SPLIT_K": 1},
    {"BLOCK_T": 32, "BLOCK_E": 32, "BLOCK_K": 32, "SPLIT_K": 3},
    {"BLOCK_T": 64, "BLOCK_E": 128, "BLOCK_K": 64, "SPLIT_K": 4}])
def test_v5_tensor_core_logits_are_exact_products(v5, cfg):
    # Odd T, H and E (masked tiles on every side, a ragged last K slice): the partials sum to the
    # exact logits, which a single BF16 term of the weight would not.
    h, w = _dyadic_inputs(21, 200, 48, 0)
    exact = h.double() @ w.double().T
    assert not torch.equal(h.double() @ w.bfloat16().double().T, exact)
    assert torch.equal(_v5_logits(v5, h, w, cfg), exact)


@pytest.mark.parametrize("t,seed", [(17, 0), (33, 1), (70, 2)])
def test_v5_real_width_with_its_tensor_core_gemm(v5, t, seed):
    # The default from 17 tokens (the top-k selection to 64, the rounds above) over H = 5120.
    args = C.make_inputs({"T": t, **REAL}, seed)
    assert v5.default_config(t)["GEMM"] == "bf16x3"
    check(args, v5.run(*args))


def test_v5_configs_stay_in_policy(v5):
    # Tiles from 16 to 128 tokens and 256 experts, split-K, both selections, the other GEMMs.
    args = C.make_inputs({"T": 70, "H": 640, "E": 256}, 9)
    ref = C.reference(*args)
    for cfg in ({}, {"BLOCK_T": 16, "BLOCK_E": 16, "BLOCK_K": 16, "SPLIT_K": 40},
                {"BLOCK_T": 128, "BLOCK_E": 256, "BLOCK_K": 128, "SPLIT_K": 1, "num_warps": 8,
                 "num_stages": 4},
                {"BLOCK_T": 32, "BLOCK_E": 64, "BLOCK_K": 32, "SPLIT_K": 5, "SEL": "topk"},
                {"GEMM": "bf16x3", "BLOCK_T": 1, "BLOCK_E": 2, "SPLIT_K": 2, "SEL_T": 8},
                {"GEMM": "dot"}, {"GEMM": "lib"}, {"GEMM": "fma", "BLOCK_T": 8, "BLOCK_E": 16}):
        assert all(v in v5.CONFIG_SPACE[k] for k, v in cfg.items()), cfg
        check(args, v5.run(*args, config=cfg), ref)
    with pytest.raises(ValueError, match="GEMM must be one of"):
        v5.run(*args, config={"GEMM": "tf32"})


def test_v5_fp32_activations_take_the_fma_tiles(v5):
    # An FP32 h is not BF16-exact: the three-term split would not give exact products, so the
    # FP32 FMA tiles run instead, with the same ids and weights as triton_v5's "dot" config.
    h, w, b, ng, tg, k = C.make_inputs({"T": 20, "H": 96, "E": 256}, 4)
    args = (h.float() * (1 + 2**-12), w, b, ng, tg, k)
    got = v5.run(*args, config={"GEMM": "bf16x3"})
    dot = v5.run(*args, config={"GEMM": "dot"})
    assert torch.equal(got[1], dot[1]) and torch.equal(got[0], dot[0])
    check(args, got)


@pytest.mark.parametrize("t,seed", [(1, 0), (5, 2), (21, 1)])
def test_v5_is_bitwise_v4_with_the_same_gemm(v4, v5, t, seed):
    # The selection and the other GEMMs are triton_v4's: the same outputs bit for bit.
    args = C.make_inputs({"T": t, "H": 640, "E": 256}, seed)
    for cfg in ({"GEMM": "fma", "BLOCK_T": 4, "BLOCK_E": 8, "BLOCK_K": 64, "SPLIT_K": 10},
                {"GEMM": "dot", "BLOCK_T": 32, "BLOCK_E": 32, "BLOCK_K": 32, "SPLIT_K": 20},
                {"GEMM": "lib", "SEL": "rounds", "SEL_T": 2}):
        w4, i4 = v4.run(*args, config=cfg)
        w5, i5 = v5.run(*args, config=cfg)
        assert torch.equal(i5, i4) and torch.equal(w5.view(torch.int32), w4.view(torch.int32))


def test_v5_default_buckets(v5):
    # triton_v4's GEMV to 16 tokens; the three-term tiles from 17, prefill included: two kernels
    # at every T.
    assert [v5.default_config(t)["GEMM"] for t in (1, 2, 4, 8, 16, 17, 64, 65, 2048)] == \
        ["fma"] * 5 + ["bf16x3"] * 4
    assert v5.default_config(64)["SEL"] == "topk" and v5.default_config(65)["SEL"] == "rounds"
    for t in (1, 2, 4, 8, 16, 17, 32, 64, 2048):
        cfg = v5.default_config(t)
        assert all(v in v5.CONFIG_SPACE[k] for k, v in cfg.items()), (t, cfg)


# --- triton_v6: triton_v5 with the three-term tiles from 5 tokens as its defaults -----------
def test_v6_default_buckets(v6):
    # triton_v4's GEMV to 4 tokens; the three-term tiles from 5, 16 x 32 to 16 tokens and
    # 32 x 64 to 32; each token tile covers its bucket's T up to 64; two kernels at every T.
    ts = (1, 2, 4, 5, 8, 16, 17, 32, 33, 64, 65, 2048)
    assert [v6.default_config(t)["GEMM"] for t in ts] == ["fma"] * 3 + ["bf16x3"] * 9
    assert all(v6.default_config(t)["BLOCK_T"] >= t for t in ts if t <= 64)
    assert (v6.default_config(8)["BLOCK_E"], v6.default_config(8)["BLOCK_K"]) == (32, 128)
    assert (v6.default_config(32)["BLOCK_E"], v6.default_config(32)["BLOCK_K"]) == (64, 64)
    assert v6.default_config(64)["SEL"] == "topk" and v6.default_config(65)["SEL"] == "rounds"
    for t in ts:
        cfg = v6.default_config(t)
        assert all(v in v6.CONFIG_SPACE[k] for k, v in cfg.items()), (t, cfg)
    # Only the defaults moved: from 65 tokens, and to 4, they are triton_v5's.
    v5 = Registry().load_variant("router", "triton_v5")
    for t in (1, 2, 4, 33, 64, 65, 2048):
        assert v6.default_config(t) == v5.default_config(t), t


@pytest.mark.parametrize("t,seed", [(5, 3), (8, 0), (16, 1), (24, 2)])
def test_v6_is_triton_v5_with_other_defaults(v5, v6, t, seed):
    # At its own defaults (the three-term tiles from 5 tokens): within policy at the real
    # width, and bit for bit triton_v5 given the same config.
    args = C.make_inputs({"T": t, **REAL}, seed)
    cfg = v6.default_config(t)
    assert cfg != v5.default_config(t) and cfg["GEMM"] == "bf16x3"
    w6, i6 = v6.run(*args)
    check(args, (w6, i6))
    w5, i5 = v5.run(*args, config=cfg)
    assert torch.equal(i6, i5) and torch.equal(w6.view(torch.int32), w5.view(torch.int32))


@pytest.mark.parametrize("variant", ["triton_v2", "triton_v4", "triton_v5", "triton_v6"])
def test_correction_biases_below_minus_two(variant):
    # Every c = s + bias below -2: the masked and already-taken experts must stay below every
    # real key (the contract's `negative_bias` edge case, which the judge runs). triton_v1 and
    # triton_v3's selection by rounds mask with -2**62, above the keys of such c: they return
    # expert E-1 eight times here (shown below), and the judge rejects them since.
    mod = Registry().load_variant("router", variant)
    args = C.make_inputs({"T": 3, "H": 64, "E": 256, "bias_offset": -4}, 5)
    ref = C.reference(*args)
    check(args, mod.run(*args), ref)
    if variant in ("triton_v4", "triton_v5", "triton_v6"):
        check(args, mod.run(*args, config={"SEL": "rounds"}), ref)
    v1 = Registry().load_variant("router", "triton_v1")
    assert not torch.equal(v1.run(*args)[1], ref[1])


def _tied_inputs(t: int, seed: int, h_dim: int = 64):
    """Router inputs whose scores tie exactly, often: logits are multiples of 1/4 in [-2, 2]
    (ternary h, sparse weights of +-1/4: every summation order is exact) and the biases take
    5 values, so equal c within a group, equal c across the top-k boundary and equal group
    scores at the kept-group boundary all occur."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randint(-1, 2, (t, h_dim), generator=g).to(torch.bfloat16)
    weight = torch.randint(-1, 2, (256, h_dim), generator=g).float() * 0.25
    weight *= torch.rand(256, h_dim, generator=g) < 4 / h_dim  # ~4 terms a logit
    bias = torch.randint(-2, 3, (256,), generator=g).float() / 32
    return h, weight, bias, 8, 4, 8


@pytest.mark.parametrize("t,seed", [(9, 0), (24, 0)])
def test_exact_ties_are_broken_as_a_tie_allows(mod, t, seed):
    # Any resolution of an exact tie is right (the reference's own, torch.topk's, is
    # unspecified); a kept group tied with a dropped one changes which experts follow. The
    # judge's tie rule (router_tie_rows) must accept each kernel's resolution, and only that.
    args = _tied_inputs(t, seed)
    h, weight, bias = args[:3]
    c = torch.sigmoid(torch.nn.functional.linear(h.float(), weight)) + bias
    gs = c.view(t, 8, 32).topk(2, dim=-1)[0].sum(-1).sort(dim=-1, descending=True).values
    assert bool((gs[:, 3] == gs[:, 4]).any()), "no group tie at the boundary: a vacuous test"
    check(args, mod.run(*args))


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_harness_verifies_it_on_cpu(variant):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "autoopt.cli", "verify", "--op", "router", "--variant",
         variant, "--device", "cpu", "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    report = json.loads(proc.stdout)
    if variant in ("triton_v1", "triton_v3"):
        # Their selection by rounds masks with a key above c <= -2 (see
        # test_correction_biases_below_minus_two): the judge's negative-bias case rejects them.
        assert report["verdict"] == "reject", report["secret"]
        assert all("negative_bias" in r for r in report["reasons"]), report["reasons"]
        return
    # The secret reproduces the run (`autoopt verify ... --secret S`).
    assert report["verdict"] == "pass", (report["secret"], report["reasons"])
    assert report["checks"]["near_misses"]["passed"]


# --- GPU (run on the GPU machine) -----------------------------------------------------------

def _gpu_args(t: int, seed: int):
    from model.config import preset

    cfg = preset("beam-1.0-501b")
    return C.make_inputs(C.shapes_for(cfg, t, cfg.shard(8)), seed, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 2, 4, 8, 16, 32, 64, 2048])
def test_gpu_within_policy(mod, t):
    for seed in (0, 1, 2):
        args = _gpu_args(t, seed)
        check(args, mod.run(*args))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8])
def test_gpu_fused_path_under_cuda_graphs(mod, t):
    args = _gpu_args(t, 0)
    first = mod.run(*args)  # warm-up outside capture (compiles, arms the counter)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mod.run(*args)
    for _ in range(3):  # replays re-arm the counter each time
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[1], first[1])
        assert torch.equal(out[0].view(torch.int32), first[0].view(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 4, 16])
def test_gpu_v3_pdl_under_graphs_is_bitwise_without_pdl_and_v1(v1, v3, t):
    # PDL changes when programs start, never what they compute: captured with a producer of h
    # in front (the GEMV waits for it), replayed, bitwise the launch without PDL and triton_v1's
    # two-kernel path with the same GEMV tiles.
    h, w, b, ng, tg, k = _gpu_args(t, 3)
    src = torch.randn_like(h)
    cfg = v3.default_config(t)
    plain = v3.run(h, w, b, ng, tg, k, config={**cfg, "PDL": 0})
    ref1 = v1.run(h, w, b, ng, tg, k, config={**{key: cfg[key] for key in
                  ("BLOCK_T", "BLOCK_E", "BLOCK_K", "SPLIT_K", "num_warps")}, "FUSE": 0,
                  "SEL_T": 1, "LIB_GEMM": 0})
    assert torch.equal(plain[1], ref1[1]) and torch.equal(plain[0].view(torch.int32),
                                                          ref1[0].view(torch.int32))
    hh = torch.empty_like(h)
    v3.run(hh.copy_(src), w, b, ng, tg, k, config=cfg)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        hh.copy_(src)  # a kernel that writes h right before the router reads it
        out = v3.run(hh, w, b, ng, tg, k, config=cfg)
    src.copy_(h)  # replays must see this h, not the one at capture
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[1], plain[1])
        assert torch.equal(out[0].view(torch.int32), plain[0].view(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 16, 32])
def test_gpu_v4_pdl_under_graphs_is_bitwise_without_pdl(v3, v4, t):
    # As triton_v3's above: PDL changes when programs start, never what they compute; up to 16
    # tokens (the FMA GEMV) the outputs are triton_v3's bit for bit, from 17 the dot tiles'.
    h, w, b, ng, tg, k = _gpu_args(t, 4)
    src = torch.randn_like(h)
    cfg = v4.default_config(t)
    plain = v4.run(h, w, b, ng, tg, k, config={**cfg, "PDL": 0})
    check((h, w, b, ng, tg, k), plain)
    if cfg["GEMM"] == "fma":
        ref3 = v3.run(h, w, b, ng, tg, k, config={**{key: cfg[key] for key in (
            "BLOCK_T", "BLOCK_E", "BLOCK_K", "SPLIT_K", "num_warps")}, "LIB_GEMM": 0,
            "SEL": "rank"})
        assert torch.equal(plain[1], ref3[1]) and torch.equal(plain[0].view(torch.int32),
                                                              ref3[0].view(torch.int32))
    hh = torch.empty_like(h)
    v4.run(hh.copy_(src), w, b, ng, tg, k, config=cfg)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        hh.copy_(src)
        out = v4.run(hh, w, b, ng, tg, k, config=cfg)
    src.copy_(h)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[1], plain[1])
        assert torch.equal(out[0].view(torch.int32), plain[0].view(torch.int32))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [
    {"BLOCK_T": 16, "BLOCK_E": 16, "BLOCK_K": 64, "SPLIT_K": 1},
    {"BLOCK_T": 32, "BLOCK_E": 32, "BLOCK_K": 64, "SPLIT_K": 3},
    {"BLOCK_T": 64, "BLOCK_E": 128, "BLOCK_K": 64, "SPLIT_K": 4}])
def test_gpu_v5_tensor_core_logits_are_exact_products(v5, cfg):
    # On the tensor cores (mma.sync, and wgmma at 64 x 128 tiles): the exact logits, bit for bit.
    h, w = _dyadic_inputs(150, 5120, 256, 1)
    exact = h.double() @ w.double().T
    got = _v5_logits(v5, h.cuda(), w.cuda(), cfg, device="cuda").cpu()
    assert torch.equal(got, exact)


# The three-term tiles at triton_v5's defaults, and at triton_v6's from 5 tokens.
TC_DEFAULTS = [("triton_v5", 32), ("triton_v5", 2048), ("triton_v6", 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("name,t", TC_DEFAULTS)
def test_gpu_three_term_logits_are_unbiased(name, t):
    # Tensor cores need not round their FP32 sums to nearest; each K step's sum is added to the
    # total in FP32 on the CUDA cores so that their rounding cannot pile up across K
    # (benchmarks/router_tc_rounding.py: one accumulator would fail the policy). Measured against
    # the FP64 logits in ulps of the sum of |products|, toward each logit's sign.
    mod = Registry().load_variant("router", name)
    h, w = _gpu_args(t, 6)[:2]
    got = _v5_logits(mod, h, w, mod.default_config(t), device="cuda").cpu()
    hd, wd = h.double().cpu(), w.double().cpu()
    exact, scale = hd @ wd.T, hd.abs() @ wd.abs().T
    ulp = torch.from_numpy(np.spacing(scale.float().numpy())).double()
    err = (got - exact) / ulp * exact.sign()
    assert err.abs().max() < 4 and abs(err.mean()) < 0.25, (err.mean(), err.abs().max())


@pytest.mark.gpu
@pytest.mark.parametrize("name,t", TC_DEFAULTS)
def test_gpu_three_term_pdl_under_graphs_is_bitwise_without_pdl(name, t):
    # The three-term tiles and the selection under a CUDA graph with PDL: the same bits as
    # launched plainly without it.
    mod = Registry().load_variant("router", name)
    h, w, b, ng, tg, k = _gpu_args(t, 5)
    src = torch.randn_like(h)
    cfg = mod.default_config(t)
    plain = mod.run(h, w, b, ng, tg, k, config={**cfg, "PDL": 0})
    check((h, w, b, ng, tg, k), plain)
    hh = torch.empty_like(h)
    mod.run(hh.copy_(src), w, b, ng, tg, k, config=cfg)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        hh.copy_(src)
        out = mod.run(hh, w, b, ng, tg, k, config=cfg)
    src.copy_(h)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[1], plain[1])
        assert torch.equal(out[0].view(torch.int32), plain[0].view(torch.int32))


@pytest.mark.slow
def test_gpu_script_dry_run(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "router_cute_gpu.py"),
                           "--dry-run", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "router_cute.json").read_text())
    routers = [r for r in report["rows"] if r["op"] == "router"]
    assert [r["T"] for r in routers] == [1, 5] and all(r["passed"] for r in routers)
    assert "| router | triton_v1 | 1 | yes |" in (tmp_path / "router_cute.md").read_text()


# --- the template agent's router family --------------------------------------------------------

def _render_template(tmp_path):
    from autoopt.agents.template import CATALOG

    (spec,) = CATALOG["router"]
    src = spec.render()
    assert "{{" not in src and src == spec.render()
    path = tmp_path / "router_splitk.py"
    path.write_text(src)
    m = importlib.util.module_from_spec(importlib.util.spec_from_file_location("rt", path))
    m.__spec__.loader.exec_module(m)
    return spec, m, path


def test_template_renders_and_tuned_configs_stay_in_policy(tmp_path):
    spec, m, _ = _render_template(tmp_path)
    space = spec.space()
    assert m.CONFIG_SPACE == space and all(k in space for k in spec.default())
    args = C.make_inputs({"T": 9, "H": 320, "E": 256}, 8)
    ref = C.reference(*args)
    for cfg in ({}, {"FUSE": 1, "SPLIT_K": 5, "BLOCK_T": 16, "BLOCK_E": 32, "BLOCK_K": 64},
                {"FUSE": 0, "SPLIT_K": 40, "BLOCK_K": 32, "SEL_T": 8, "SEL_WARPS": 4},
                {"TC_GEMM": 1, "BLOCK_K": 64, "SPLIT_K": 2},
                {"TC_GEMM": 1, "TC_BLOCK_T": 64, "TC_BLOCK_E": 128, "BLOCK_K": 128,
                 "SPLIT_K": 1, "SEL_T": 4}):
        assert all(v in space[k] for k, v in cfg.items())
        check(args, m.run(*args, config=cfg), ref)
    # Past the FMA tiles' 64 tokens the tensor-core tiles still run (cuBLAS only without them).
    big = C.make_inputs({"T": 70, "H": 96, "E": 256}, 3)
    check(big, m.run(*big, config={"TC_GEMM": 1, "TC_BLOCK_T": 32, "TC_BLOCK_E": 64,
                                    "BLOCK_K": 32, "SPLIT_K": 2}))


def test_template_tensor_core_logits_are_exact_products(tmp_path):
    # The template's TC_GEMM tiles on dyadic inputs (every partial sum exact): the exact logits.
    _, m, _ = _render_template(tmp_path)
    h, w = _dyadic_inputs(21, 200, 48, 2)
    part = torch.full((2, 21, 48), float("nan"))
    m._router_tc_kernel[(3, 2, 1)](h, w, part, 21, 200, h.stride(0), w.stride(0), E=48,
                                   BLOCK_T=32, BLOCK_E=16, BLOCK_K=64, K_STEPS=2, ON_GPU=False)
    assert torch.equal(part.double().sum(0), h.double() @ w.double().T)


@pytest.mark.slow
def test_template_and_hand_written_variants_compile_for_sm90(tmp_path):
    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.is_file():
        pytest.skip("no ptxas bundled with triton here")
    _, _, rendered = _render_template(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    for path in (ROOT / "kernels" / "router" / "triton_v1.py", rendered):
        res = subprocess.run([sys.executable, "-c", _SM90, str(path)], env=env,
                             capture_output=True, text=True, timeout=600)
        assert res.returncode == 0 and res.stdout.count("ok") == 4, res.stderr[-3000:]
    res = subprocess.run([sys.executable, "-c", _SM90_V2,
                          str(ROOT / "kernels" / "router" / "triton_v2.py")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.count("ok") == 4, res.stderr[-3000:]
    res = subprocess.run([sys.executable, "-c", _SM90_V3,
                          str(ROOT / "kernels" / "router" / "triton_v3.py")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.count("ok") == 7, res.stderr[-3000:]
    res = subprocess.run([sys.executable, "-c", _SM90_V4,
                          str(ROOT / "kernels" / "router" / "triton_v4.py")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.count("ok") == 7, res.stderr[-3000:]
    for path, which, n in ((ROOT / "kernels" / "router" / "triton_v5.py", "v5", 5),
                           (ROOT / "kernels" / "router" / "triton_v6.py", "v5", 5),
                           (rendered, "template", 2)):
        res = subprocess.run([sys.executable, "-c", _SM90_TC, str(path), which], env=env,
                             capture_output=True, text=True, timeout=600)
        assert res.returncode == 0 and res.stdout.count("ok") == n, res.stderr[-3000:]


# The fused decode kernels (FMA GEMV + atomic counter + selection), the FMA prefill tiles (a
# K loop) and the selection kernel, compiled to sm_90 PTX without a GPU.
_SM90 = '''
import importlib.util, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
spec = importlib.util.spec_from_file_location("v", sys.argv[1])
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
P, F, N, C = "*bf16", "*fp32", "i32", "constexpr"
base = dict(E=256, NG=8, TOPK_GROUP=4, TOP_K=8, ON_GPU=True)
def go(fn, types, cx):
    k = triton.compile(ASTSource(fn, dict(zip(fn.arg_names, types)), cx),
                       target=GPUTarget("cuda", 90, 32))
    assert ".target sm_90" in k.asm["ptx"]
    print("ok")
gemv = [P, F, F, F, F, "*i64", "*i32", N, N, N, N] + [C] * 13
for cfg in (dict(BLOCK_T=1, BLOCK_E=16, BLOCK_K=256, K_STEPS=1, FUSE=True),
            dict(BLOCK_T=8, BLOCK_E=8, BLOCK_K=64, K_STEPS=4, FUSE=True),
            dict(BLOCK_T=16, BLOCK_E=16, BLOCK_K=32, K_STEPS=160, FUSE=False)):
    go(m._router_gemv_kernel, gemv, {**base, **cfg, "H_BF16": True, "SEL_T": cfg["BLOCK_T"],
                                     "SPLIT": 5120 // (cfg["K_STEPS"] * cfg["BLOCK_K"])})
go(m._router_select_kernel, [F, F, F, "*i64", N] + [C] * 7, {**base, "SEL_T": 4, "SPLIT": 20})
'''

# triton_v2: the fused kernel (whole-expert GEMV, per-block counter, ranking selection) unrolled
# and as a K loop, the GEMV alone, and the selection kernel from logits.
_SM90_V2 = '''
import importlib.util, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
spec = importlib.util.spec_from_file_location("v", sys.argv[1])
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
P, F, N, C = "*bf16", "*fp32", "i32", "constexpr"
base = dict(E=256, NG=8, TOPK_GROUP=4, TOP_K=8, ON_GPU=True)
def go(fn, types, cx):
    k = triton.compile(ASTSource(fn, dict(zip(fn.arg_names, types)), cx),
                       target=GPUTarget("cuda", 90, 32))
    assert ".target sm_90" in k.asm["ptx"]
    print("ok")
gemv = [P, F, F, F, F, "*i64", "*i32", N, N, N, N] + [C] * 11
for cfg in (dict(BLOCK_T=1, BLOCK_E=2, BLOCK_K=1024, K_STEPS=5, FUSE=True),
            dict(BLOCK_T=2, BLOCK_E=2, BLOCK_K=256, K_STEPS=20, FUSE=True),
            dict(BLOCK_T=16, BLOCK_E=8, BLOCK_K=64, K_STEPS=80, FUSE=False)):
    go(m._router_gemv_kernel, gemv, {**base, **cfg, "H_BF16": True})
go(m._router_select_kernel, [F, F, F, "*i64", N] + [C] * 6, {**base, "FROM_LOGITS": True})
'''

# triton_v3: the GEMV unrolled (one step) and as a K loop, with and without PDL (its
# griddepcontrol instructions in the PTX), and both selection kernels with and without it.
_SM90_V3 = '''
import importlib.util, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
spec = importlib.util.spec_from_file_location("v", sys.argv[1])
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
P, F, N, C = "*bf16", "*fp32", "i32", "constexpr"
def go(fn, types, cx):
    k = triton.compile(ASTSource(fn, dict(zip(fn.arg_names, types)), cx),
                       target=GPUTarget("cuda", 90, 32))
    ptx = k.asm["ptx"]
    assert ".target sm_90" in ptx
    assert ("griddepcontrol.wait" in ptx) == bool(cx["PDL"]), cx
    print("ok")
gemv = [P, F, F, N, N, N, N] + [C] * 7
for cfg in (dict(BLOCK_T=1, BLOCK_E=8, BLOCK_K=256, K_STEPS=1, PDL=True),
            dict(BLOCK_T=16, BLOCK_E=4, BLOCK_K=128, K_STEPS=2, PDL=True),
            dict(BLOCK_T=1, BLOCK_E=8, BLOCK_K=256, K_STEPS=1, PDL=False)):
    go(m._router_gemv_kernel, gemv, {"E": 256, "H_BF16": True, **cfg})
sel = [F, F, F, "*i64", N] + [C] * 7
for pdl in (True, False):
    go(m._router_select_kernel, sel, dict(SPLIT=20, E=256, NG=8, TOPK_GROUP=4, TOP_K=8,
                                          ON_GPU=True, PDL=pdl))
    go(m._router_select_rounds_kernel, sel + [C], dict(SPLIT=1, E=256, NG=8, TOPK_GROUP=4,
                                                       TOP_K=8, SEL_T=1, ON_GPU=True, PDL=pdl))
'''

# triton_v4: the FMA GEMV and the dot tiles (a K loop of FP32 FMAs: no tensor-core instruction in
# the PTX) with and without PDL, and both selections.
_SM90_V4 = '''
import importlib.util, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
spec = importlib.util.spec_from_file_location("v", sys.argv[1])
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
P, F, N, C = "*bf16", "*fp32", "i32", "constexpr"
def go(fn, types, cx, nw=4):
    k = triton.compile(ASTSource(fn, dict(zip(fn.arg_names, types)), cx),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=nw))
    ptx = k.asm["ptx"]
    assert ".target sm_90" in ptx
    assert ("griddepcontrol.wait" in ptx) == bool(cx["PDL"]), cx
    assert "mma" not in ptx and "tf32" not in ptx, "an FP32 router must not touch tensor cores"
    print("ok")
gemm = [P, F, F, N, N, N, N] + [C] * 7
go(m._router_gemv_kernel, gemm, dict(E=256, H_BF16=True, BLOCK_T=1, BLOCK_E=8, BLOCK_K=256,
                                     K_STEPS=1, PDL=True), 1)
for cfg in (dict(BLOCK_T=32, BLOCK_E=32, BLOCK_K=32, K_STEPS=8, PDL=True),
            dict(BLOCK_T=64, BLOCK_E=64, BLOCK_K=64, K_STEPS=80, PDL=False),
            dict(BLOCK_T=16, BLOCK_E=16, BLOCK_K=16, K_STEPS=2, PDL=True)):
    go(m._router_dot_kernel, gemm, {"E": 256, "H_BF16": True, **cfg})
sel = [F, F, F, "*i64", N] + [C] * 7
for pdl in (True, False):
    go(m._router_select_topk_kernel, sel, dict(SPLIT=20, E=256, NG=8, TOPK_GROUP=4, TOP_K=8,
                                               ON_GPU=True, PDL=pdl), 8)
go(m._router_select_rounds_kernel, sel + [C], dict(SPLIT=1, E=256, NG=8, TOPK_GROUP=4,
                                                   TOP_K=8, SEL_T=1, ON_GPU=True, PDL=True), 1)
'''

# The three-term tiles (triton_v5's and the template's TC_GEMM) compile to BF16 tensor-core
# products with FP32 accumulation (wgmma at 64-row tiles on 4 warps, mma.sync below), never TF32,
# each K step's three products from zero and added to the total in FP32; triton_v5's selection
# kernels are triton_v4's. argv: the file, then "v5" or "template".
_SM90_TC = '''
import importlib.util, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
spec = importlib.util.spec_from_file_location("v", sys.argv[1])
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
P, F, N, C = "*bf16", "*fp32", "i32", "constexpr"
def go(fn, types, cx, nw=4, mma=None):
    k = triton.compile(ASTSource(fn, dict(zip(fn.arg_names, types)), cx),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=nw, num_stages=3))
    ptx = k.asm["ptx"]
    assert ".target sm_90" in ptx
    assert ("griddepcontrol.wait" in ptx) == bool(cx.get("PDL")), cx
    assert "tf32" not in ptx, "TF32 rounds the weight: not the router's FP32 products"
    if mma:
        ops = set(re.findall(r"\\b(?:wgmma\\.mma_async|mma\\.sync)[.\\w]*", ptx))
        assert ops and all(".f32.bf16.bf16" in op for op in ops), ops
        assert any(op.startswith(mma) for op in ops), (mma, ops)
        ttg = k.asm["ttgir"]
        accs = re.findall(r"(?:tt\\.dot|ttng\\.warp_group_dot) %\\S+, %\\S+, (%[\\w#]+)", ttg)
        assert len(accs) == 3 and accs[0].startswith("%cst") and "arith.addf" in ttg, accs
    print("ok")
if sys.argv[2] == "template":
    for cfg, mma in ((dict(BLOCK_T=64, BLOCK_E=128, BLOCK_K=64, K_STEPS=20), "wgmma"),
                     (dict(BLOCK_T=16, BLOCK_E=32, BLOCK_K=64, K_STEPS=4), "mma.sync")):
        go(m._router_tc_kernel, [P, F, F, N, N, N, N] + [C] * 6, {"E": 256, "ON_GPU": True, **cfg},
           mma=mma)
    sys.exit(0)
gemm = [P, F, F, N, N, N, N] + [C] * 7
for cfg, mma in ((dict(BLOCK_T=64, BLOCK_E=128, BLOCK_K=64, K_STEPS=20, PDL=True), "wgmma"),
                 (dict(BLOCK_T=32, BLOCK_E=32, BLOCK_K=64, K_STEPS=4, PDL=False), "mma.sync"),
                 (dict(BLOCK_T=16, BLOCK_E=16, BLOCK_K=16, K_STEPS=2, PDL=True), "mma.sync")):
    go(m._router_bf16x3_kernel, gemm, {"E": 256, "ON_GPU": True, **cfg}, mma=mma)
sel = [F, F, F, "*i64", N] + [C] * 7
go(m._router_select_topk_kernel, sel, dict(SPLIT=20, E=256, NG=8, TOPK_GROUP=4, TOP_K=8,
                                           ON_GPU=True, PDL=True), 8)
go(m._router_select_rounds_kernel, sel + [C], dict(SPLIT=4, E=256, NG=8, TOPK_GROUP=4,
                                                   TOP_K=8, SEL_T=1, ON_GPU=True, PDL=True), 1)
'''
