"""The verify trials in-process (no sandbox): every op's reference passes its own verifier, every
near miss that shows on the inputs is rejected by name, and the behavioural guards fire."""

from __future__ import annotations

import pytest
import torch

from autoopt.eval import guards
from autoopt.eval.shapes import cpu_shapes, gpu_shapes
from autoopt.eval.trials import arg_names, near_misses_for
from autoopt.eval.verify import prepare_all, run_trials
from model.ops import CONTRACTS, contract

OPS = sorted(CONTRACTS)
SEEDS = (0, 1)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny shapes: intra-op threads only contend on a busy 2-core runner (as in the sandbox).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _trials(op: str, tokens=(1, 17)):
    c = contract(op)
    shapes = cpu_shapes(op, tokens)
    return c, shapes, prepare_all(c, shapes, SEEDS, "cpu")


def _as_variant(fn):
    return lambda *a, config=None: fn(*a)


@pytest.mark.parametrize("op", OPS)
def test_reference_passes_its_own_verifier(op):
    c, _, prepared = _trials(op)
    run = _as_variant(c.reference)
    reasons, checks, per_shape = run_trials(c, run, prepared, {"device": "cpu"})
    assert reasons == []
    assert len(per_shape) == len(prepared)
    assert all(o["mismatches"] == 0 for o in checks["numerics"]["outputs"])


@pytest.mark.parametrize("op", OPS)
def test_every_visible_near_miss_is_rejected_by_name(op):
    c, shapes, prepared = _trials(op, tokens=(1, 17, 123))
    near = {}
    for s in shapes:
        near.update(near_misses_for(c, s))
    if not near:
        pytest.skip(f"{op} declares no near misses")
    for name, fn in near.items():
        reasons, checks, _ = run_trials(c, _as_variant(fn), prepared, {"device": "cpu"})
        status = checks["near_misses"]["by_name"][name]["status"]
        if status == "not distinguishable on these inputs":
            continue  # recorded, not failed: the near miss equals the reference here
        assert any(f"closer to near miss {name!r}" in r for r in reasons), (name, reasons)


def test_arg_names_follow_the_signature():
    assert arg_names(contract("swiglu").signature) == ["gate", "up"]
    assert arg_names(contract("router").signature) == [
        "h", "weight", "bias", "n_group", "topk_group", "top_k"]
    assert arg_names(contract("moe_experts").signature)[-1] == "expert_offset"


def _run_swiglu(fn, tokens=(1, 17)):
    c, _, prepared = _trials("swiglu", tokens)
    return run_trials(c, fn, prepared, {"device": "cpu"})[0]


def _swiglu(gate, up):
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)


def test_mutation_and_aliasing_are_named():
    def cheat(gate, up, config=None):
        up.mul_(1)  # a no-op write still leaves the values equal: not a mutation
        gate.copy_(_swiglu(gate, up))
        return gate

    text = "\n".join(_run_swiglu(cheat))
    assert "output 0 aliases input 0 (gate)" in text and "mutated input 0 (gate)" in text
    assert "mutated input 1" not in text


def test_pointer_cache_is_named():
    cache = {}

    def cheat(gate, up, config=None):
        key = (gate.data_ptr(), up.data_ptr())
        if key not in cache:
            cache[key] = _swiglu(gate, up)
        return cache[key].clone()

    assert any("caches outputs by data pointer" in r for r in _run_swiglu(cheat))


def test_exceptions_and_structure_are_named():
    def raises(gate, up, config=None):
        raise RuntimeError("boom")

    assert any("candidate raised RuntimeError: boom" in r for r in _run_swiglu(raises))

    def two(gate, up, config=None):
        return _swiglu(gate, up), gate

    assert any("returned 2 outputs, expected 1" in r for r in _run_swiglu(two))

    def sub(gate, up, config=None):
        return _swiglu(gate, up).as_subclass(torch.nn.Parameter)

    assert any("expected a plain torch.Tensor" in r for r in _run_swiglu(sub))


def test_nondeterminism_is_named():
    def noisy(gate, up, config=None):
        out = _swiglu(gate, up)
        flip = torch.rand(out.shape) < 0.05
        return torch.where(flip, -out, out)

    assert any("nondeterministic: two runs differ" in r for r in _run_swiglu(noisy))


def test_input_blind_candidate_is_named():
    def blind(gate, up, config=None):
        return _swiglu(gate, torch.ones_like(up))

    text = "\n".join(_run_swiglu(blind))
    assert "not input dependent: output unchanged when input 1 (up) changed" in text
    assert "input 0 (gate)" not in text


def test_patched_globals_sees_a_replaced_timer():
    import time

    snap = guards.snapshot_globals()
    original = time.perf_counter
    try:
        time.perf_counter = lambda: 0.0
        assert guards.patched_globals(snap) == ["time.perf_counter"]
    finally:
        time.perf_counter = original
    assert guards.patched_globals(snap) == []


def test_poison_mask_and_floor_violation():
    t = torch.tensor([1.0, float("nan"), 2.0], dtype=torch.bfloat16)
    t.view(torch.int16)[2] = 0x7F7F  # glibc MALLOC_PERTURB_ fill pattern
    assert guards.poison_mask(t).tolist() == [False, True, True]
    assert guards.floor_violation(1.0, 2.0) is not None
    assert guards.floor_violation(1.9, 2.0) is None


@pytest.mark.parametrize("op", OPS)
def test_default_shapes_cover_every_op(op):
    cpu = cpu_shapes(op)
    assert cpu and any(s["T"] % 2 == 1 and s["T"] > 1 for s in cpu)
    gpu = gpu_shapes(op, (1, 128))
    assert len(gpu) == 2 and gpu[1]["T"] == 128
    contract(op).cost(gpu[1])  # the cost model accepts the shapes
