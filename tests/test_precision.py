"""The GEMM precision the op contracts assume (model/ops/precision.py): the judge's references,
the worker that runs a candidate and the serving engine all run at it."""

from __future__ import annotations

import pytest
import torch

from model.ops import precision

CONTRACT = precision.contract_flags()


@pytest.fixture
def loose_flags():
    """Every flag at its loosest, as a user's process might have them; restored after."""
    m = torch.backends.cuda.matmul
    saved = {k: getattr(m, k) for k in precision.FLAGS}
    cudnn = torch.backends.cudnn.allow_tf32
    for k in precision.FLAGS:
        setattr(m, k, True)
    torch.backends.cudnn.allow_tf32 = True
    yield
    for k, v in saved.items():
        setattr(m, k, v)
    torch.backends.cudnn.allow_tf32 = cudnn


def test_contract_precision_sets_every_flag_and_restores_them(loose_flags):
    assert all(precision.current().values())
    with precision.contract_precision():
        assert precision.current() == CONTRACT
    assert all(precision.current().values())
    with pytest.raises(RuntimeError), precision.contract_precision():
        raise RuntimeError("a failing block restores the flags too")
    assert all(precision.current().values())


def test_reduced_precision_reductions_are_off_under_the_contract(loose_flags):
    # PyTorch's default lets cuBLAS add split-K partials in BF16: the contracts round once.
    assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    with precision.contract_precision():
        assert not torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        assert not torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
        assert not torch.backends.cuda.matmul.allow_tf32


def test_a_candidates_worker_runs_at_the_contract_precision():
    from autoopt.eval.channel import Worker

    with Worker("cpu", budget_s=60) as w:
        assert w.precision == CONTRACT


def test_the_engine_serves_at_the_contract_precision(loose_flags):
    from autoopt.profiler.rank import build_rank_model
    from autoopt.targets import load_target
    from model.serve.engine import EngineConfig, LLMEngine

    cfg = dict(device="cpu", max_num_seqs=2, max_model_len=64, kv_cache_bytes=8 << 20)
    model = build_rank_model(load_target("cpu-tiny"), 1, "cpu", 0).model
    LLMEngine(EngineConfig(kernels="reference", **cfg), model=model)
    assert precision.current() == CONTRACT
