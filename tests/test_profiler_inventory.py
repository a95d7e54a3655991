"""The op inventory of a served step is what its forward calls (autoopt/profiler/inventory.py),
also under TP, and the step's floor counts the experts its routing hit (profiler/floor.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autoopt import env
from autoopt.profiler.attribution import Rates
from autoopt.profiler.floor import step_floor
from autoopt.profiler.inventory import record_step, recording, step_inventory
from autoopt.profiler.rank import build_rank_model
from autoopt.profiler.served import ServedStep, ServeShape
from autoopt.targets import load_target
from model import beam
from model.ops import OpTable

RATES = Rates(1e9, 1e12, 5e11, "test", meaningful=False)


def _key(calls) -> list[tuple]:
    """What an inventory says, routing aside: (name, shape, count), in a stable order."""
    return sorted((c.name, tuple(sorted(c.shape.items())), c.count) for c in calls)


def _served(target, batch: int, layers: int | None = None, seed: int = 0) -> ServedStep:
    rank = build_rank_model(target, layers, "cpu", seed)
    served = ServedStep(rank.model, ServeShape(target.phase, batch, target.contexts[0], steps=6),
                        cuda_graphs=False, seed=seed)
    served.start(batch)
    return served


def test_inventory_is_what_the_served_forward_calls():
    t = load_target("cpu-tiny")
    served = _served(t, 3)
    calls, logits = record_step(served)
    assert logits.shape == (3, t.shard.vocab_size)
    # The meta-device inventory (no memory, no kernels) records the same calls.
    assert _key(step_inventory(t, 3)) == _key(calls)
    names = {c.name for c in calls}
    assert "allreduce_norm_residual_norm" not in names and "norm_residual_norm" in names
    cfg = t.config()
    count = {c.name: 0 for c in calls}
    for c in calls:
        count[c.name] += c.count
    assert count["norm_residual_norm"] == 2 * cfg.num_hidden_layers
    # Decode attention is one paged call per layer over every sequence.
    assert count["attention"] == cfg.num_hidden_layers
    assert count["paged_attention"] == cfg.num_hidden_layers  # the backend's range, per layer
    assert count["logit_softcap"] == 1 and count["lm_head"] == 1


def test_recording_restores_the_model():
    t = load_target("cpu-tiny")
    served = _served(t, 1, layers=4)
    ops, region = served.model.ops, beam.region
    with pytest.raises(RuntimeError, match="boom"), recording(served.model):
        raise RuntimeError("boom")
    assert served.model.ops is ops and beam.region is region


def _tp2_target(tmp: Path):
    text = (env.tasks_dir() / "cpu-tiny.toml").read_text()
    text = text.replace('name = "cpu-tiny"', 'name = "cpu-tiny-tp2"').replace("tp = 1", "tp = 2")
    path = tmp / "cpu-tiny-tp2.toml"
    path.write_text(text)
    return path


def _rank_inventory(group, target_path: str) -> list[tuple]:
    """One gloo rank: its model, attached to the real group, served and recorded."""
    from autoopt.profiler.rank import fill_random
    from model.beam import BeamForCausalLM
    from model.parallel import attach

    t = load_target(target_path)
    model = BeamForCausalLM(t.config(), t.shard, rank=group.rank)
    fill_random(model, torch.Generator().manual_seed(1))
    attach(model, group)
    served = ServedStep(model, ServeShape("decode", 2, t.contexts[0], steps=4), cuda_graphs=False)
    served.start(2)
    calls, _ = record_step(served)
    return _key(calls)


@pytest.mark.slow
def test_inventory_under_tp_matches_every_gloo_rank(tmp_path):
    from model.parallel import launch

    path = _tp2_target(tmp_path)
    ranks = launch(_rank_inventory, 2, args=(str(path),), timeout_s=300)
    want = _key(step_inventory(load_target(path), 2))
    assert ranks[0] == ranks[1] == want
    names = {name for name, _, _ in want}
    assert "allreduce_norm_residual_norm" in names and "norm_residual_norm" not in names
    n = load_target(path).config().num_hidden_layers
    arn = [(shape, count) for name, shape, count in want if name == "allreduce_norm_residual_norm"]
    assert sum(c for _, c in arn) == 2 * n and all(dict(s)["R"] == 2 for s, _ in arn)


def test_touched_experts_come_from_the_step_routing():
    t = load_target("cpu-tiny")
    served = _served(t, 5, seed=3)
    model = served.model
    seen: list[torch.Tensor] = []
    router = model.ops.impl("router")

    def watched(*args):
        weights, ids = router(*args)
        seen.append(ids.clone())
        return weights, ids

    model.set_ops(OpTable({"router": watched}))
    calls, _ = record_step(served)
    (moe,) = [c for c in calls if c.name == "moe_experts"]
    assert moe.touched == tuple(int(torch.unique(ids).numel()) for ids in seen)
    assert 8 <= min(moe.touched) and max(moe.touched) <= 32  # 5 tokens x top-8 of 32 experts
    floor = step_floor(calls, model, "decode", 5, t.contexts[0], RATES)
    # The same arithmetic from the model's buffers, written out.
    cfg, shard = model.config, model.shard
    layer = next(x for x in model.layers if not x.dense)
    one_expert = 2 * (layer.experts_gate_up[0].numel() + layer.experts_down[0].numel())
    dense = sum(b.numel() * b.element_size() for n, b in model.named_buffers()
                if not n.endswith(("experts_gate_up", "experts_down", "embed_tokens")))
    weights = dense + 5 * cfg.hidden_size * 2 + one_expert * sum(moe.touched)
    per_token = 2 * shard.num_key_value_heads * cfg.head_dim * 2
    keys = sum(min(40, cfg.window(i) or 40) + 1 for i in range(cfg.num_hidden_layers))
    kv = 5 * keys * per_token
    assert (floor.weight_bytes, floor.expert_bytes, floor.kv_bytes) == (
        weights, one_expert * sum(moe.touched), kv)
    assert floor.routing == "recorded" and floor.experts_held == 32
    assert floor.bound == "bytes"
    assert floor.floor_us == pytest.approx((weights + kv) / RATES.bandwidth_bytes_s * 1e6)


def test_the_meta_inventory_bounds_the_routing_from_above():
    t = load_target("cpu-tiny")
    calls = step_inventory(t, 17)
    (moe,) = [c for c in calls if c.name == "moe_experts"]
    assert moe.touched == ()
    with torch.device("meta"):
        model = beam.BeamForCausalLM(t.config(), t.shard)
    floor = step_floor(calls, model, "decode", 17, 40, RATES)
    assert floor.routing.startswith("upper bound")
    assert floor.experts_touched == (32,) * moe.count  # min(E, T*k) = min(32, 136)


def test_gpu_targets_under_tp8_call_the_fused_boundary():
    # No GPU needed: the inventory of the H200 TP8 rank is recorded on the meta device.
    t = load_target("h200-tp8-decode")
    calls = step_inventory(t, 8, layers=6)
    names = {c.name for c in calls}
    assert "allreduce_norm_residual_norm" in names and "norm_residual_norm" not in names
    # Decode attention is the paged attention op, called inside the backend's range.
    assert "attention" in names and "paged_attention" in names
    shapes = t.op_shapes(8, layers=6)
    assert shapes["allreduce_norm_residual_norm"] == {"R": 8, "T": 8, "H": 5120}
    assert shapes["moe_experts"]["T"] == 8 and shapes["logit_softcap"]["V"] == 151936
