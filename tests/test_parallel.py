"""Tensor parallelism over real gloo process groups: spawned ranks vs TP=1 on the tiny checkpoint.

The tiny preset has 4 query / 2 KV heads, so TP4 replicates KV heads; 32 experts, vocab 2048.
Each launch spawns real processes (about 2-5 s each on 2 cores), so checks share launches.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from model.demo import write_demo_checkpoint
from model.ops import allreduce_norm_residual_norm as arn
from model.ops import norm_residual_norm
from model.parallel import TPError, TPGroup, attach, launch
from model.weights import load_model

from .test_kernels_triton_v1 import check_policy

PROMPTS = torch.tensor([[7, 100, 200, 300, 1500, 2047, 9], [7, 5, 1024, 1023, 2000, 42, 11]])
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(write_demo_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt"))


def _greedy(model, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy decoding with a full forward per step (no cache): [B, S + steps]."""
    for _ in range(steps):
        nxt = model(ids)[:, -1].argmax(-1)
        ids = torch.cat([ids, nxt[:, None]], dim=1)
    return ids


def _boundary_outputs(group: TPGroup) -> dict:
    """Each rank's seeded partial through the "gather" and "allreduce" boundaries (on CPU)."""
    from model.ops import OpTable

    shape = {"R": group.size, "T": 17, "H": 64}
    partials, *args = arn.make_inputs(shape, seed=9, device=group.device)
    out = {}
    for impl in ("gather", "allreduce"):
        group.boundary_impl = impl
        mine = partials[group.rank].clone()  # "allreduce" reduces in place
        out[impl] = [t.cpu() for t in group.boundary(OpTable(), mine, *args)]
    # The registry's fused kernel for the stacked op (Triton; the interpreter on CPU) plugged
    # into the distributed boundary, as `--kernels tuned` does on an sm_90 GPU.
    from model.registry import Registry

    fused = Registry().load_variant(arn.NAME, "triton_v1")
    group.boundary_impl = "gather"
    table = OpTable({arn.NAME: fused.run}, {arn.NAME: "triton_v1"})
    out["gather+fused"] = [t.cpu() for t in group.boundary(table, partials[group.rank].clone(),
                                                            *args)]
    out["partials"] = partials.cpu()
    out["args"] = [a.cpu() if torch.is_tensor(a) else a for a in args]
    return out


def _model_run(group: TPGroup, ckpt: str, ep: int) -> dict:
    """FP32 logits and greedy tokens, BF16 logits, and the boundary check, for one rank."""
    out = {}
    prompts = PROMPTS.to(group.device)
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = load_model(ckpt, dtype=dtype, device=str(group.device), tp=group.size,
                           rank=group.rank, ep=ep)
        attach(model, group)
        out[f"logits_{name}"] = model(prompts).cpu()
        if dtype == torch.float32:
            out["greedy"] = _greedy(model, prompts, NEW_TOKENS).cpu()
            out["op_calls"] = _count_boundary_calls(model, prompts[:1])
    if group.size > 1:
        out["boundary"] = _boundary_outputs(group)
    return out


@pytest.fixture(scope="module")
def tp1(checkpoint) -> dict:
    # One thread, like each spawned rank: on a busy 2-core machine torch's 2-thread CPU kernels
    # run tens of times slower than one thread (measured 7.7 s vs 0.2 s for one forward).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return launch(_model_run, 1, args=(checkpoint, 1))[0]
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("tp,ep", [(2, 1), (4, 1), (2, 2)], ids=["tp2", "tp4", "tp2-ep2"])
def test_tp_matches_tp1(checkpoint, tp1, tp, ep):
    _check_against_tp1(launch(_model_run, tp, args=(checkpoint, ep), timeout_s=300), tp1, tp)


@pytest.mark.gpu
def test_nccl_tp2_matches_tp1(checkpoint):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    ref = launch(_model_run, 1, backend="nccl", args=(checkpoint, 1))[0]
    ranks = launch(_model_run, 2, backend="nccl", args=(checkpoint, 1), timeout_s=300)
    _check_against_tp1(ranks, ref, 2)


def _check_against_tp1(ranks: list[dict], tp1: dict, tp: int) -> None:
    first = ranks[0]
    # Every rank computes the same logits bit for bit (deterministic rank sums, vocab gather).
    for other in ranks[1:]:
        for key in ("logits_fp32", "logits_bf16", "greedy"):
            assert torch.equal(other[key], first[key]), key
    # FP32: row-parallel partial sums reassociate every o_proj/down/expert GEMM sum; through 8
    # layers with a norm after each branch the logits (|z| <= 30 after the softcap) move by a
    # few FP32 ulps at 30 (1.9e-6 each; measured <= 2.1e-6). 1e-4 leaves 50x margin and is still
    # far below any real error (a wrong slice or a missing partial moves logits by ~1).
    torch.testing.assert_close(first["logits_fp32"], tp1["logits_fp32"], atol=1e-4, rtol=0)
    assert torch.equal(first["greedy"], tp1["greedy"])
    # At TP > 1 every boundary is the fused all-reduce boundary, never a separate sum + norm.
    layers = 8
    assert tp1["op_calls"] == {"norm_residual_norm": 2 * layers}
    assert first["op_calls"] == {"allreduce_norm_residual_norm": 2 * layers}
    # BF16: the rank sum rounds at different points than TP1's single GEMM, so logits move by
    # BF16 rounding noise; TP must stay within 2x the noise of BF16 itself (TP1 BF16 vs FP32).
    tp_noise = (first["logits_bf16"] - tp1["logits_bf16"]).abs().mean()
    bf16_noise = (tp1["logits_bf16"] - tp1["logits_fp32"]).abs().mean()
    assert tp_noise <= 2 * bf16_noise
    _check_boundaries(ranks, tp)


def _check_boundaries(ranks: list[dict], tp: int) -> None:
    b0 = ranks[0]["boundary"]
    want = arn.reference(b0["partials"], *b0["args"])
    for rank in ranks:
        got = rank["boundary"]["gather"]
        # The distributed boundary is the single-process op on the stacked partials, bitwise.
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        # The fused kernel on the gathered partials: within the op's policy on CPU (its norms
        # sum in torch's CUDA order, the CPU reference in the CPU order); bitwise on GPUs.
        check_policy(arn.NAME, tuple(rank["boundary"]["gather+fused"]), tuple(want))
    if tp == 2:
        # One BF16 add of two partials rounds like the FP32 sum: the backend's all-reduce
        # (gloo here, NCCL in the GPU test) matches bitwise.
        got = ranks[0]["boundary"]["allreduce"]
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def _count_boundary_calls(model, prompt: torch.Tensor) -> dict[str, int]:
    """How often one forward calls each boundary op."""
    from model.ops import OpTable

    counts: dict[str, int] = {}

    def counting(name, fn):
        def wrapped(*args):
            counts[name] = counts.get(name, 0) + 1
            return fn(*args)
        return wrapped

    ops = model.ops
    model.set_ops(OpTable({
        "allreduce_norm_residual_norm": counting("allreduce_norm_residual_norm", arn.reference),
        "norm_residual_norm": counting("norm_residual_norm", norm_residual_norm.reference),
    }))
    model(prompt)
    model.set_ops(ops)
    return counts


def _die_mid_generation(group: TPGroup, ckpt: str, how: str, stamp: str) -> None:
    model = attach(load_model(ckpt, dtype=torch.float32, tp=group.size, rank=group.rank), group)
    model(PROMPTS)
    if group.rank == 1:
        Path(stamp).write_text(repr(time.time()))
        if how == "exit":
            os._exit(3)
        if how == "raise":
            raise ValueError("rank 1 gave up")
        os.kill(os.getpid(), 9)
    _greedy(model, PROMPTS, 50)  # rank 0 waits on rank 1 inside a collective


@pytest.mark.parametrize("how,expect", [
    ("exit", "rank 1 exited with code 3"),
    ("kill", "rank 1 was killed by SIGKILL"),
    ("raise", "rank 1 raised ValueError: rank 1 gave up"),
])
def test_dead_rank_ends_the_group_with_a_message(checkpoint, tmp_path, how, expect):
    stamp = tmp_path / "died_at"
    with pytest.raises(TPError, match=expect) as info:
        # The process-group timeout is long on purpose: the launcher must end the group, not it.
        launch(_die_mid_generation, 2, args=(checkpoint, how, str(stamp)), timeout_s=300,
               pg_timeout_s=600)
    # From the death to the error: the launcher sees the exit at once, waits up to 2 s for a
    # cause when a survivor reports first, and gives the survivors 5 s to stop. 30 s bounds it
    # even on a loaded machine; a hang would instead run into the 300/600 s timeouts above.
    assert time.time() - float(stamp.read_text()) < 30
    assert "stopped" in str(info.value) and "gloo, 2 ranks" in str(info.value)


def _sleep(group: TPGroup) -> None:
    time.sleep(600)


def test_launch_timeout_stops_the_ranks():
    start = time.monotonic()
    with pytest.raises(TPError, match="did not finish within 3 s"):
        launch(_sleep, 2, timeout_s=3)
    assert time.monotonic() - start < 30
