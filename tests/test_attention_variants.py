"""The attention block's registry variants under the Triton interpreter, through the harness.

Every variant passes the verifier's trials (structure, poison, in-place outputs, determinism,
pointer caching, input dependence, numerics, near misses) on small shapes: tiny head dims and
GQA ratios, pages of 1, 4 and 5 slots, sliding windows, decode rows and prefill chunks, and each
config path (one split, many splits, a split-K GEMV, the library GEMM). Then the edges the
trials do not reach: slots a query may not see holding NaN, empty splits, and candidates that
break the in-place cache contract.
"""

from __future__ import annotations

import pytest
import torch

from autoopt.eval.plan import Budget
from model.ops import contract
from model.registry import Registry
from tests.test_eval_trials import session


@pytest.fixture(scope="module")
def variants():
    reg = Registry()
    return {(op, name): reg.load_variant(op, name) for op, name in (
        ("attention", "triton_v1"), ("qkv_gate_proj", "triton_v1"),
        ("qkv_gate_proj", "triton_v2"), ("qk_norm_rope", "template_rows_v2"),
        ("qk_norm_ssmax", "template_rows_v2"),
        ("gated_o_proj", "template_splitk_v1"), ("gated_o_proj", "template_splitk_v2"))}


def _verify(op: str, run, shapes: list[dict], config: dict | None = None, seeds=(0,)):
    """The judge's whole session in this process (tests/test_eval_trials.py): the given bucket
    shapes plus the drawn, long and edge-case ones it adds, small token counts."""
    budget = Budget(seeds=len(seeds), max_tokens=24)
    reasons, checks, _ = session(op, lambda *a: run(*a, config=config), budget, shapes=shapes)
    return reasons, {"numerics": checks["numerics"], "near_misses": checks["near"]}


ATTENTION_SHAPES = [
    {"T": 1, "seqs": 0, "S": 37, "Hq": 6, "Hkv": 1, "D": 32, "W": 0, "page": 4},
    {"T": 3, "seqs": 0, "S": 21, "Hq": 4, "Hkv": 2, "D": 16, "W": 5, "page": 5},
    {"T": 2, "seqs": 0, "S": 9, "Hq": 2, "Hkv": 2, "D": 16, "W": 0, "page": 1},
    {"T": 7, "seqs": 2, "S": 30, "Hq": 6, "Hkv": 1, "D": 16, "W": 6, "page": 4},  # chunks
]


@pytest.mark.slow
# One split (no combine), and the automatic split count over 16-key chunks (up to four splits at
# these contexts, an empty one among them). The wide and two-level combines are held to the
# reference bit for bit in tests/test_attention_splits.py, at a fraction of a judge session's cost.
@pytest.mark.parametrize("config", [{"SPLITS": 1, "BLOCK_N": 16},
                                    {"SPLITS": 0, "BLOCK_N": 16, "MIN_BLOCKS": 1}])
def test_attention_triton_v1_passes_the_harness(variants, config):
    reasons, checks = _verify("attention", variants["attention", "triton_v1"].run,
                              ATTENTION_SHAPES, config)
    assert reasons == [], reasons
    by_name = checks["near_misses"]["by_name"]
    assert {by_name[n]["status"] for n in by_name} == {"closer to the reference"}


@pytest.mark.slow
@pytest.mark.parametrize("window", [0, 4])
def test_attention_never_reads_slots_it_may_not_see(variants, window):
    # Every slot no query may see holds NaN (stale pages, freed and reused pages, the null
    # page): the output must equal the reference's on a clean cache and be finite.
    c = contract("attention")
    shape = {"T": 4, "seqs": 0, "S": 23, "Hq": 4, "Hkv": 2, "D": 16, "W": window, "page": 4}
    q, kc, vc, table, base, q_seq, q_pos, w, scale = c.make_inputs(shape, 3)
    ref = c.reference(q, kc, vc, table, base, q_seq, q_pos, w, scale)
    seen = torch.zeros(kc.shape[0] * kc.shape[1], dtype=torch.bool)
    for t in range(q.shape[0]):
        row, p = int(q_seq[t]), int(q_pos[t])
        lo = max(int(base[row]), p - w + 1) if w else int(base[row])
        j = torch.arange(lo, p + 1) - int(base[row])
        seen[table[row][j // kc.shape[1]] * kc.shape[1] + j % kc.shape[1]] = True
    dirty_k, dirty_v = kc.clone().flatten(0, 1), vc.clone().flatten(0, 1)
    dirty_k[~seen], dirty_v[~seen] = float("nan"), float("nan")
    dirty = (dirty_k.view_as(kc), dirty_v.view_as(vc))
    for config in ({"SPLITS": 1, "BLOCK_N": 16}, {"SPLITS": 16, "BLOCK_N": 16}):
        got = variants["attention", "triton_v1"].run(q, *dirty, table, base, q_seq, q_pos, w,
                                                     scale, config=config)
        assert torch.isfinite(got.float()).all()
        assert torch.equal(got, ref)  # the interpreter keeps the reference's bits here
    # The reference itself is as careful (its decode form masks what it gathers).
    assert torch.equal(c.reference(q, *dirty, table, base, q_seq, q_pos, w, scale), ref)


@pytest.mark.slow
@pytest.mark.parametrize("config", [{"SPLIT_K": 1, "BLOCK_N": 16, "BLOCK_K": 128},
                                    {"SPLIT_K": 4, "BLOCK_N": 32, "BLOCK_K": 64}])
def test_qkv_gate_proj_triton_v1_passes_the_harness(variants, config):
    # 1 and 5 tokens through the GEMV, 17 through the library GEMM.
    shapes = [{"T": t, "H": 192, "Hq": 6, "Hkv": 1, "D": 16} for t in (1, 5, 17)]
    reasons, _ = _verify("qkv_gate_proj", variants["qkv_gate_proj", "triton_v1"].run, shapes,
                         config)
    assert reasons == [], reasons


@pytest.mark.slow
@pytest.mark.parametrize("config", [{}, {"SPLIT_K": 3, "BLOCK_N": 8, "BLOCK_K": 32},
                                    {"SPLIT_K": 1, "BLOCK_N": 0, "BLOCK_K": 256,
                                     "GEMV_MAX_T": 16}])
def test_qkv_gate_proj_triton_v2_passes_the_harness(variants, config):
    # 1 and 5 tokens through the multiply-reduce GEMV (5: three padded rows of 8), 17 through
    # the library GEMM; {} is the default (automatic rows, five splits, the library above 8).
    shapes = [{"T": t, "H": 192, "Hq": 6, "Hkv": 1, "D": 16} for t in (1, 5, 17)]
    reasons, _ = _verify("qkv_gate_proj", variants["qkv_gate_proj", "triton_v2"].run, shapes,
                         config)
    assert reasons == [], reasons


@pytest.mark.parametrize("config", [{"BLOCK_N": 3}, {"BLOCK_K": 100}, {"SPLIT_K": 0},
                                    {"num_warps": 3}])
def test_qkv_gate_proj_triton_v2_refuses_a_bad_config(variants, config):
    c = contract("qkv_gate_proj")
    args = c.make_inputs({"T": 1, "H": 64, "Hq": 2, "Hkv": 1, "D": 16}, 0)
    with pytest.raises(ValueError):
        variants["qkv_gate_proj", "triton_v2"].run(*args, config=config)


@pytest.mark.parametrize("t", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("h", [7, 64, 349])
def test_qkv_gate_proj_triton_v2_gemv_matches_exact_sums(variants, t, h):
    # Every T <= 16 through the GEMV (odd widths: masked tails, a split longer than the rest):
    # within one rounding of the exact (float64) product, and at most 1 ulp from cuBLAS's.
    c = contract("qkv_gate_proj")
    x, w, hq, hkv = c.make_inputs({"T": t, "H": h, "Hq": 2, "Hkv": 1, "D": 16}, t + h)
    exact = x.double() @ w.double().T
    for config in ({"GEMV_MAX_T": 16}, {"GEMV_MAX_T": 16, "SPLIT_K": 4, "BLOCK_K": 16,
                                        "BLOCK_N": 1}):
        got = torch.cat([o.reshape(t, -1) for o in variants["qkv_gate_proj", "triton_v2"].run(
            x, w, hq, hkv, config=config)], 1)
        assert torch.equal(got, got.double().to(torch.bfloat16))
        err = (got.double() - exact).abs()
        ulp = exact.abs().to(torch.bfloat16).double().clamp_min(2.0**-126) * 2.0**-8
        assert (err <= ulp * 1.01 + 1e-6 * exact.abs().max()).all(), err.max()


@pytest.mark.slow
@pytest.mark.parametrize("config", [{"SPLIT_K": 1, "BLOCK_N": 16, "BLOCK_K": 64},
                                    {"SPLIT_K": 3, "BLOCK_N": 32, "BLOCK_K": 32}, {}])
@pytest.mark.parametrize("name", ["template_splitk_v1", "template_splitk_v2"])
def test_gated_o_proj_template_passes_the_harness(variants, config, name):
    # 1 token through the gated GEMV (v2: a multiply-reduce; K = 6 heads x 16 in splits of
    # whole and partial heads), 5 through its 16-row dot, 17 through the gate kernel and the
    # library GEMM; {} is the default config (v2: wide tiles, four splits).
    shapes = [{"T": t, "Hq": 6, "D": 16, "H": 80} for t in (1, 5, 17)]
    reasons, _ = _verify("gated_o_proj", variants["gated_o_proj", name].run, shapes, config)
    assert reasons == [], reasons


@pytest.mark.parametrize("t", [1, 2, 19])
@pytest.mark.parametrize("name", ["template_splitk_v1", "template_splitk_v2"])
def test_gated_o_proj_reads_heads_major_attention(variants, t, name):
    # Attention may hand back [T, Hq, D] with the heads outermost in memory: the same values in
    # another layout give the same bits, on both paths.
    c = contract("gated_o_proj")
    attn, gate, bias, w = c.make_inputs({"T": t, "Hq": 3, "D": 32, "H": 48}, 5)
    heads_major = attn.transpose(0, 1).contiguous().transpose(0, 1)
    gate_slice = torch.cat([gate, gate], dim=-1)[..., :32]  # a column slice, as from the GEMM
    run = variants["gated_o_proj", name].run
    want = run(attn, gate, bias, w)
    assert torch.equal(run(heads_major, gate_slice, bias, w), want)
    assert (want.float() - c.reference(attn, gate, bias, w).float()).abs().max() < 0.05


def test_the_verifier_rejects_a_gate_left_in_fp32_before_the_gemm():
    c = contract("gated_o_proj")
    shapes = [{"T": t, "Hq": 6, "D": 16, "H": 80} for t in (1, 5)]
    reasons, _ = _verify("gated_o_proj", lambda *a, config=None:
                         c.numerics.near_misses["unrounded_gated"](*a), shapes)
    assert any("unrounded_gated" in r for r in reasons), reasons


@pytest.mark.parametrize("t", [1, 5, 17, 33])
@pytest.mark.parametrize("template", ["mr", "splitk"])
def test_qkv_gate_proj_template_reads_only_its_rows_of_a_padded_input(t, template):
    # Rows of x one row length apart with NaN between them (a judge's or serving's view): the
    # template's GEMV and its library path (torch's CPU BF16 GEMM reads past a row's end and
    # multiplies the padding by zero: NaN padding gave NaN rows) give the reference's bits.
    import importlib.util
    import tempfile
    from pathlib import Path

    from autoopt.agents.template import CATALOG

    (spec,) = [s for s in CATALOG["qkv_gate_proj"] if s.name == template]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "qkv_template.py"
        path.write_text(spec.render())
        mod_spec = importlib.util.spec_from_file_location("qkv_template", path)
        mod = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(mod)
    c = contract("qkv_gate_proj")
    x, w, hq, hkv = c.make_inputs({"T": t, "H": 276, "Hq": 6, "Hkv": 1, "D": 16}, 2)
    base = torch.full((t, 2 * 276), float("nan"), dtype=x.dtype)
    padded = base[:, :276]
    padded.copy_(x)
    # Every T <= 16 through the GEMV where the template has that switch.
    config = {"GEMV_MAX_T": 16} if "GEMV_MAX_T" in mod.CONFIG_SPACE else None
    got, want = mod.run(padded, w, hq, hkv, config=config), c.reference(x, w, hq, hkv)
    for g, r in zip(got, want, strict=True):
        assert not torch.isnan(g).any()
        assert (g.float() - r.float()).abs().max() <= 2e-2 * r.float().abs().max()


def test_qkv_gate_proj_outputs_are_views_of_one_gemm(variants):
    c = contract("qkv_gate_proj")
    x, w, hq, hkv = c.make_inputs({"T": 3, "H": 64, "Hq": 6, "Hkv": 1, "D": 16}, 0)
    for run in (variants["qkv_gate_proj", "triton_v1"].run,
                variants["qkv_gate_proj", "triton_v2"].run, c.reference):
        q, k, v, g = run(x, w, hq, hkv)  # one GEMM output, four views: no copies
        base = q.untyped_storage().data_ptr()
        assert all(t.untyped_storage().data_ptr() == base for t in (k, v, g))
        assert (q.shape, k.shape, v.shape, g.shape) == ((3, 6, 16), (3, 1, 16), (3, 1, 16),
                                                        (3, 6, 16))


@pytest.mark.slow
@pytest.mark.parametrize("op", ["qk_norm_rope", "qk_norm_ssmax"])
def test_fused_kv_write_variants_pass_the_harness(variants, op):
    shapes = [{"T": 1, "Hq": 6, "Hkv": 1, "D": 32, "page": 1},
              {"T": 17, "Hq": 4, "Hkv": 2, "D": 32, "page": 4},
              {"T": 9, "Hq": 6, "Hkv": 1, "D": 128, "page": 16, "P": 2}]
    reasons, checks = _verify(op, variants[op, "template_rows_v2"].run, shapes,
                              {"ROWS": 4, "num_warps": 4}, seeds=(0, 1))
    assert reasons == [], reasons
    outs = checks["numerics"]["outputs"]
    assert len(outs) == 3 and outs[2]["mismatches"] == 0  # V reaches the cache bit for bit


def _rope_args(seed: int = 0):
    c = contract("qk_norm_rope")
    return c, list(c.make_inputs({"T": 5, "Hq": 4, "Hkv": 2, "D": 32, "page": 4}, seed))


def test_the_verifier_requires_the_cache_updated_in_place():
    c, _ = _rope_args()

    def copies(*args, config=None):  # right values, but in new tensors: the cache is not written
        a = [x.clone() if isinstance(x, torch.Tensor) else x for x in args]
        return c.reference(*a)

    reasons, _ = _verify("qk_norm_rope", copies, [{"T": 5, "Hq": 4, "Hkv": 2, "D": 32}])
    assert any("must be input 8 (k_cache) updated in place" in r for r in reasons), reasons


@pytest.mark.parametrize("flaw", ["wrong_slots", "no_v", "raw_k"])
def test_the_verifier_rejects_a_wrong_cache_write(flaw):
    from model.ops import qk_norm_rope as op
    from model.ops._paged import write_kv

    def bad(q, k, v, qw, kw, cos, sin, eps, kc, vc, slots, config=None):
        q_out, k_out = op.norm_rope(q, k, qw, kw, cos, sin, eps)
        if flaw == "wrong_slots":
            slots = slots.flip(0)
        if flaw == "no_v":
            v = vc.flatten(0, 1)[slots]
        write_kv(kc, vc, slots, k if flaw == "raw_k" else k_out, v)
        return q_out, kc, vc

    reasons, _ = _verify("qk_norm_rope", bad, [{"T": 5, "Hq": 4, "Hkv": 2, "D": 32, "page": 4}])
    assert any("output 1" in r or "output 2" in r for r in reasons), reasons
