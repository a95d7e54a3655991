"""The whole model through the registry: a lock selecting the Triton variants vs the reference.

A test lock in a tmp dir gives a `[cpu]` section selecting the five hand-written Triton variants
from the repo's kernels/ (run by the interpreter on CPU); the tiny demo checkpoint is loaded
once with it and once with `--kernels reference`.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from model.demo import write_demo_checkpoint
from model.registry import KernelRefusedWarning, Lock, Registry, sha256, writers
from model.weights import load_model

# An accepted hand-written Triton variant of each op (its first, where that is still shipped).
HAND = {"rmsnorm": "triton_v2", "norm_residual_norm": "triton_v3", "attn_output_gate": "triton_v2",
        "swiglu": "triton_v2", "logit_softcap": "triton_v2"}
TRITON_OPS = tuple(HAND)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo"), "tiny", seed=0)


@pytest.fixture(scope="module")
def test_lock(tmp_path_factory):
    # Pinned as `autoopt registry lock` pins (the records carry a CPU verification of each).
    repo = Registry()
    path = tmp_path_factory.mktemp("lock") / "registry.lock.toml"
    path.write_text(Lock({"cpu": {op: writers.lock_entry(repo, op, HAND[op], "cpu")
                                  for op in TRITON_OPS}}).to_toml())
    return path


def test_tuned_lock_matches_reference_logits(checkpoint, test_lock):
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelRefusedWarning)  # nothing may be refused
        tuned = load_model(checkpoint, device="cpu", kernels=test_lock)
    reference = load_model(checkpoint, device="cpu", kernels="reference")
    for op in TRITON_OPS:
        assert tuned.ops.sources[op].startswith(f"{HAND[op]} ("), tuned.ops.sources[op]
        assert reference.ops.sources[op] == "reference"
    # Few tokens: the interpreter runs every norm row as its own program (~50 ms each).
    ids = torch.tensor([[7, 11, 300, 42], [3, 1, 4, 1]])
    got, want = tuned(ids), reference(ids)
    assert got.dtype == want.dtype == torch.float32
    assert torch.equal(got.argmax(-1), want.argmax(-1))  # greedy decoding is identical
    # Policies allow a norm output to move by 1 BF16 ulp (~0.4% relative), which 8 layers could
    # carry to ~1e-2 on these logits (|z| < 3); the softcap may move by 1 FP32 ulp (interpreter
    # tanh). Measured here: only softcap ulps, max 3e-8.
    torch.testing.assert_close(got, want, rtol=0, atol=0.05)


def test_default_kernels_on_cpu_are_the_reference(checkpoint):
    # The repo lock has no [cpu] section: a CPU model runs every op's reference.
    model = load_model(checkpoint, device="cpu")
    assert set(model.ops.sources.values()) == {"reference"}


def test_fp32_model_runs_the_reference_even_with_a_lock(checkpoint, test_lock):
    # The variants implement the BF16 contracts (they refuse FP32 tensors): an FP32 parity model
    # with --kernels tuned/<lock> must run the references, say why, and not warn.
    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelRefusedWarning)
        model = load_model(checkpoint, dtype=torch.float32, device="cpu", kernels=test_lock)
    assert set(model.ops.sources.values()) == {"reference"}
    for op in TRITON_OPS:
        res = model.ops.resolution[op]
        assert res.variant == HAND[op] and "BF16 contracts" in res.refused
    ids = torch.tensor([[7, 11, 300, 42]])
    want = load_model(checkpoint, dtype=torch.float32, device="cpu", kernels="reference")(ids)
    assert torch.equal(model(ids), want)


def test_refused_variant_keeps_the_model_running(checkpoint, test_lock, tmp_path):
    text = test_lock.read_text().replace(sha256(Registry().variant_path("swiglu", "triton_v2")),
                                         "0" * 64)
    bad = tmp_path / "bad.lock.toml"
    bad.write_text(text)
    with pytest.warns(KernelRefusedWarning, match="swiglu/triton_v2 refused"):
        model = load_model(checkpoint, device="cpu", kernels=bad)
    assert model.ops.sources["swiglu"] == "reference"
    assert model.ops.sources["rmsnorm"].startswith(HAND["rmsnorm"])
    logits = model(torch.tensor([[7, 11]]))
    assert torch.isfinite(logits).all()
