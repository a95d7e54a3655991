"""TP8 on CPU: eight gloo ranks of a tiny Beam (8 query heads, 2 KV heads replicated 4x) vs TP1.

Each test starts eight real processes on a small machine (~20-60 s): the model forward and greedy
tokens, the "oneshot" boundary's fallback on gloo, a random-weights model directory, the serving
engine, and `run_on_ranks` with the communication floor.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model.config import preset
from model.demo import write_demo_checkpoint
from model.parallel import TPGroup, attach, launch
from model.tp_measure import comm_floor, step_comm_floor_us
from model.tp_ranks import (
    RankContext,
    RankModelSpec,
    random_weights_seed,
    run_on_ranks,
    write_random_model_dir,
)
from model.weights import load_model

from .test_parallel import PROMPTS, _check_against_tp1, _model_run

TP = 8
CONFIG = preset("tiny").replace(num_attention_heads=8)  # TP8 needs 8 query heads

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(write_demo_checkpoint(tmp_path_factory.mktemp("tiny8") / "ckpt", config=CONFIG))


@pytest.fixture(scope="module")
def random_dir(tmp_path_factory) -> str:
    return str(write_random_model_dir(tmp_path_factory.mktemp("rand8") / "m", CONFIG, seed=3))


def _tp8_rank(group: TPGroup, ckpt: str, rand: str) -> dict:
    group.boundary_impl = "oneshot"  # gloo: the start-up decides for the all-gather fallback
    out = _model_run(group, ckpt, 1)
    out["note"] = group.boundary_note
    model = attach(load_model(rand, dtype=torch.float32, tp=group.size, rank=group.rank), group)
    out["random_logits"] = model(PROMPTS).cpu()
    layer = model.layers[0]
    out["random_norm"], out["random_o_proj"] = layer.input_norm.clone(), layer.o_proj.clone()
    return out


def test_gloo_tp8_matches_tp1(checkpoint, random_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tp1 = launch(_model_run, 1, args=(checkpoint, 1))[0]
    finally:
        torch.set_num_threads(threads)
    ranks = launch(_tp8_rank, TP, args=(checkpoint, random_dir), timeout_s=900)
    # Greedy tokens equal, FP32 logits within the TP tolerance, BF16 within 2x BF16's own noise,
    # the fused boundary bitwise equal to the stacked reference on every rank.
    _check_against_tp1(ranks, tp1, TP)
    assert all("gather fallback" in r["note"] for r in ranks), ranks[0]["note"]
    # The random-weights directory: replicated tensors equal on every rank, shards differ, and
    # the ranks' deterministic sums give every rank the same logits.
    first = ranks[0]
    assert torch.isfinite(first["random_logits"]).all()
    for other in ranks[1:]:
        assert torch.equal(other["random_logits"], first["random_logits"])
        assert torch.equal(other["random_norm"], first["random_norm"])
        assert not torch.equal(other["random_o_proj"], first["random_o_proj"])


def test_engine_tp8_greedy_equals_tp1(checkpoint):
    from model.serve.engine import LLMEngine
    from model.serve.engine.tp_worker import generate_tp

    from .test_serve_tp import PARAMS, engine_config
    from .test_serve_tp import PROMPTS as SERVE_PROMPTS

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want = LLMEngine(engine_config(Path(checkpoint), 1)).generate(SERVE_PROMPTS, PARAMS)
    finally:
        torch.set_num_threads(threads)
    out = generate_tp(engine_config(Path(checkpoint), TP), SERVE_PROMPTS, PARAMS, threads=1,
                      timeout_s=900)
    assert [r.token_ids for r in out.completions] == [r.token_ids for r in want]
    assert len(out.free_pages) == TP and all(f == out.free_pages[0] for f in out.free_pages)
    assert "tensor parallel over 8 ranks (gloo" in out.startup_report


def _floor_rank(ctx: RankContext, tokens: int) -> dict:
    m = ctx.model
    floor = comm_floor(ctx.group, tokens, m.config.hidden_size, m.shard.vocab_size, repeats=3,
                       inner=2)
    logits = m(torch.arange(tokens)[None] % m.config.vocab_size)[0]
    return {"floor": floor, "notes": ctx.notes, "rank": ctx.group.rank, "logits": logits}


def test_run_on_ranks_returns_rank_0s_result(random_dir):
    spec = RankModelSpec(config=CONFIG, seed=5, dtype="bfloat16", kernels="reference")
    out = run_on_ranks(_floor_rank, TP, spec, args=(3,), timeout_s=900)
    assert out["rank"] == 0 and out["logits"].shape == (3, CONFIG.vocab_size)
    floor = out["floor"]
    assert {"nccl_allgather", "nccl_allreduce", "vocab_gather"} <= set(floor)
    assert "oneshot_allreduce" not in floor  # gloo: no peer buffers
    assert floor["boundary_exchange_us"] == min(floor["nccl_allgather"]["median_us"],
                                                floor["nccl_allreduce"]["median_us"])
    assert step_comm_floor_us(floor, 8) > 17 * floor["boundary_exchange_us"]
    assert any("random (seed 5)" in n for n in out["notes"])
    assert random_weights_seed(random_dir) == 3 and random_weights_seed(Path(random_dir).parent) \
        is None
