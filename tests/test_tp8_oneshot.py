"""The one-shot boundary kernel (kernels/allreduce_norm_residual_norm/oneshot_v1.py) on CPU.

Under the Triton interpreter: its arithmetic on the stacked partials against triton_v1 (bitwise)
and the op's reference (policy, near misses), and the peer-to-peer path over simulated ranks'
buffers in one process (model/p2p.py `simulate_ranks`): every rank publishes, then every rank
waits and reads the others' buffers, over several calls with odd and varying token counts. The
sm_90 build is compiled here too (ptxas ships with triton), to check its memory-ordering
instructions without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from model import p2p
from model.ops import CONTRACTS
from model.ops import allreduce_norm_residual_norm as arn
from model.parallel import TPError, init_tp
from model.registry import Registry

from .test_kernels_triton_v1 import check_policy, mismatches

SHAPES = [{"R": 2, "T": 1, "H": 5120}, {"R": 3, "T": 5, "H": 320}, {"R": 8, "T": 3, "H": 320},
          {"R": 8, "T": 17, "H": 64}, {"R": 3, "T": 33, "H": 64}]


@pytest.fixture(scope="module")
def kernels():
    reg = Registry()
    return reg.load_variant(arn.NAME, "triton_v1"), reg.load_variant(arn.NAME, "oneshot_v1")


def _equal(a: tuple, b: tuple) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s.values())))
def test_stacked_form_is_triton_v1_bitwise(kernels, shape, seed):
    v1, oneshot = kernels
    args = arn.make_inputs(shape, seed)
    got = oneshot.run(*args)
    assert _equal(got, v1.run(*args))
    ref = arn.reference(*args)
    check_policy(arn.NAME, got, ref)
    near = dict(arn.NUMERICS.near_misses)
    if shape["R"] >= 3:
        near.update(arn.MULTI_RANK_NEAR_MISSES)
    own = mismatches(got, ref)
    for name, fn in near.items():
        out = fn(*args)
        if mismatches(out, ref):
            assert mismatches(got, out) > own, name


def _calls(ranks: int, tokens: list[int], hidden: int, seed: int):
    for i, t in enumerate(tokens):
        yield arn.make_inputs({"R": ranks, "T": t, "H": hidden}, seed=seed * 100 + i)


@pytest.mark.parametrize("ranks,seed", [(2, 0), (3, 1), (8, 2)])
def test_simulated_ranks_read_each_others_buffers(kernels, ranks, seed):
    """Every rank's one-shot boundary equals triton_v1 on the stacked partials, call after call
    (odd token counts, the full capacity, fewer rows than the call before)."""
    v1, _ = kernels
    tokens = [5, 7, 1, 7, 3]
    views = p2p.simulate_ranks(ranks, capacity=7, hidden=64, spin_limit=2)
    for call, (partials, *rest) in enumerate(_calls(ranks, tokens, 64, seed)):
        for r, view in enumerate(views):
            view.publish(partials[r])
        want = v1.run(partials, *rest)
        for view in views:
            assert _equal(view.wait_boundary(*rest), want), f"call {call}, rank {view.rank}"
    for view in views:
        view.check()
        # One epoch per call that reached the row, so each row alternates slots on its own.
        assert view.mine.epochs.tolist() == [sum(t > row for t in tokens) for row in range(7)]


def test_all_reduce_is_the_rank_order_sum():
    for ranks in (2, 3, 8):
        views = p2p.simulate_ranks(ranks, capacity=9, hidden=64)
        for partials, *_ in _calls(ranks, [9, 4], 64, seed=ranks):
            for r, view in enumerate(views):
                view.publish(partials[r])
            want = arn.rank_sum(partials)
            for view in views:
                assert torch.equal(view.wait_all_reduce(partials.shape[1]), want)


def test_a_rank_one_call_ahead_leaves_the_laggards_slot_intact(kernels):
    """Rank 0 finishes call 1 and publishes call 2 into the other slot before rank 1 reads call
    1: rank 1 still reads call 1's partials; rank 0's wait for call 2 needs rank 1's publish."""
    v1, _ = kernels
    (p1, *r1), (p2, *r2), (p3, *r3) = _calls(2, [3, 3, 3], 64, seed=5)
    zero, one = p2p.simulate_ranks(2, capacity=4, hidden=64, spin_limit=2)
    zero.publish(p1[0])
    one.publish(p1[1])
    assert _equal(zero.wait_boundary(*r1), v1.run(p1, *r1))
    zero.publish(p2[0])  # the other slot: rank 1 has not read call 1 yet
    assert _equal(one.wait_boundary(*r1), v1.run(p1, *r1))
    one.publish(p2[1])
    for view in (zero, one):
        assert _equal(view.wait_boundary(*r2), v1.run(p2, *r2))
    zero.publish(p3[0])
    zero.wait_boundary(*r3)  # rank 1 never publishes call 3: the wait gives up
    with pytest.raises(p2p.P2PError, match=r"rank 0: waited .* for rank\(s\) \[1\]"):
        zero.check()
    one.check()


def test_a_wait_for_a_missing_peer_sets_the_status():
    views = p2p.simulate_ranks(3, capacity=4, hidden=64, spin_limit=3)
    partials, *rest = next(_calls(3, [2], 64, seed=3))
    views[0].publish(partials[0])
    views[2].publish(partials[2])
    views[0].wait_boundary(*rest)
    assert int(views[0].mine.status) == 1 << 1
    with pytest.raises(p2p.P2PError, match=r"rank\(s\) \[1\]"):
        views[0].check()


def test_bad_buffers_and_calls_are_refused(kernels):
    _, oneshot = kernels
    view = p2p.simulate_ranks(2, capacity=4, hidden=64)[0]
    assert view.fits(torch.zeros(4, 64, dtype=torch.bfloat16))
    for bad in (torch.zeros(5, 64, dtype=torch.bfloat16), torch.zeros(0, 64, dtype=torch.bfloat16),
                torch.zeros(2, 64), torch.zeros(2, 32, dtype=torch.bfloat16),
                torch.zeros(64, 2, dtype=torch.bfloat16).t()):
        assert not view.fits(bad)
    with pytest.raises(ValueError, match="tokens do not fit buffers of 4 rows"):
        oneshot.allreduce_peers(view.data, view.flags[0], view.mine.epochs, view.mine.status, 5)
    with pytest.raises(ValueError, match="flags must be int64"):
        oneshot.allreduce_peers(view.data, view.flags[0].int(), view.mine.epochs,
                                view.mine.status, 1)
    with pytest.raises(ValueError, match="1 <= R <= 8"):
        oneshot.run(*arn.make_inputs({"R": 9, "T": 1, "H": 64}, seed=0))
    with pytest.raises(ValueError, match="partial must be bf16"):
        view.publish(torch.zeros(2, 64))
    with pytest.raises(p2p.P2PError, match="disagree on size"):
        view.mine.views(torch.zeros(10, dtype=torch.uint8))


def test_multicast_stays_off(monkeypatch):
    for key in p2p.MULTICAST_OFF:
        monkeypatch.delenv(key, raising=False)
    p2p.disable_multicast()
    assert {k: p2p.os.environ[k] for k in p2p.MULTICAST_OFF} == p2p.MULTICAST_OFF
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    with pytest.raises(p2p.P2PError, match="NCCL_NVLS_ENABLE='1' asks for NVLink multicast"):
        p2p.disable_multicast()
    with pytest.raises(TPError, match="must not be used"):
        init_tp(2, 0, backend="nccl")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0")
    with pytest.raises(p2p.P2PError, match="TORCH_SYMM_MEM_DISABLE_MULTICAST"):
        p2p.disable_multicast()


def test_registered_as_a_variant_of_the_boundary_op():
    from model.registry import read_declarations

    reg = Registry()
    assert "oneshot_v1" in reg.variants(arn.NAME)
    source = reg.variant_path(arn.NAME, "oneshot_v1").read_text()
    assert read_declarations(source).language == "triton"
    from autoopt.eval.guards import static_screen

    assert static_screen(source) == []
    assert CONTRACTS[arn.NAME].reference is arn.reference


# ---- the sm_90 build ------------------------------------------------------------------------
# Compiled in a child process: this one runs Triton's interpreter (tests/conftest.py).
_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from model.registry import Registry

k = Registry().load_variant("allreduce_norm_residual_norm", "oneshot_v1")


def build(kernel, signature, constexprs, num_warps=4):
    sig = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    src = ASTSource(kernel, sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps}).asm["ptx"]


ptrs = {f"p{i}": "*bf16" for i in range(8)}
flags = {f"f{i}": "*i64" for i in range(8)}
pub = build(k._allreduce_norm_residual_norm_publish_kernel, {
    "part_ptr": "*bf16", "data_ptr": "*bf16", "epochs_ptr": "*i64", **flags,
    "stride_part": "i64", "slot_stride": "i64", "cap": "i64", "rank": "i32"},
    {"N": 5120, "BLOCK": 1024, "R": 8, "ON_GPU": True})
row = build(k._allreduce_norm_residual_norm_rowsum_kernel, {
    **ptrs, "flags_ptr": "*i64", "epochs_ptr": "*i64", "status_ptr": "*i32",
    "out_ptr": "*bf16", "stride_branch": "i64", "slot_stride": "i64", "cap": "i64",
    "stride_out": "i64"},
    {"N": 5120, "BLOCK": 1024, "R": 8, "ON_GPU": True, "PEERS": True, "SPIN_LIMIT": 1 << 28})
# The boundary's row program at one token (torch's layout: 512 lanes, 16 warps).
fwd = build(k._allreduce_norm_residual_norm_fwd_kernel, {
    **ptrs, "flags_ptr": "*i64", "epochs_ptr": "*i64", "status_ptr": "*i32", "res_ptr": "*bf16",
    "post_w_ptr": "*bf16", "next_w_ptr": "*bf16", "normed_ptr": "*bf16", "new_res_ptr": "*bf16",
    "stride_branch": "i64", "slot_stride": "i64", "cap": "i64", "stride_res": "i64",
    "stride_normed": "i64", "stride_new_res": "i64", "inv_n": "fp32", "eps": "fp32",
    "scale_a": "fp32", "scale_b": "fp32"},
    {"N": 5120, "TX": 512, "VEC": 4, "NCHUNK": 3, "UNROLL": 3, "R": 8, "ON_GPU": True,
     "PEERS": True, "SPIN_LIMIT": 1 << 28}, num_warps=16)
json.dump({"publish": pub, "rowsum": row, "fwd": fwd}, sys.stdout)
"""


@pytest.mark.slow
def test_sm90_build_orders_its_flags_at_system_scope():
    """publish: data stores, a CTA barrier, a system-scope fence, then relaxed system-scope
    stores into the 8 peers' flags; the row program polls the flags with volatile loads, traps
    on a timeout and fences at system scope before reading. No multicast (multimem) anywhere."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.backends.nvidia")
    repo = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(repo), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, "-c", _COMPILE], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode:
        pytest.skip(f"cannot build for sm_90 here: {proc.stderr.strip().splitlines()[-1:]}")
    ptx = json.loads(proc.stdout)
    pub, row = ptx["publish"], ptx["rowsum"]
    body = pub[pub.index(".entry"):]
    assert body.count("atom.global.sys.relaxed.exch.b64") == 8 and "release" not in body
    assert (body.rindex("st.global") < body.index("bar.sync")
            < body.index("fence.acq_rel.sys") < body.index("relaxed.exch"))
    for body in (ptx["rowsum"], ptx["fwd"]):
        body = body[body.index(".entry"):]
        assert "ld.volatile.global" in body and "trap;" in body
        assert body.index("ld.volatile.global") < body.rindex("fence.acq_rel.sys")
    assert "multimem" not in pub + row + ptx["fwd"]
