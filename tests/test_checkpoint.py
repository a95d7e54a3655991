"""Bad checkpoints fail with messages that name the tensor and what was expected."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from model import CheckpointError, load_model
from model.config import BeamConfig, preset
from model.demo import write_demo_checkpoint


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo") / "ckpt", "tiny", seed=1)


@pytest.fixture
def copy(demo, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(demo, dst)
    return dst


def _rewrite(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_demo_checkpoint_loads_and_runs(demo):
    m = load_model(demo)
    out = m(torch.tensor([[1, 2, 3, 4, 5]]))
    assert out.shape == (1, 5, preset("tiny").vocab_size) and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert m.layers[3].router_weight.dtype == torch.float32  # the router stays FP32


def test_missing_tensor(copy):
    _rewrite(copy, lambda t: t.pop("model.layers.2.self_attn.gate_bias"))
    with pytest.raises(CheckpointError, match=r"missing 1 tensor.*layers\.2\.self_attn\.gate_bias"):
        load_model(copy)


def test_unexpected_tensor(copy):
    _rewrite(copy, lambda t: t.__setitem__("model.layers.0.mystery.weight", torch.zeros(3)))
    with pytest.raises(CheckpointError, match="unexpected.*mystery"):
        load_model(copy)


def test_wrong_shape(copy):
    name = "model.layers.4.self_attn.q_proj.weight"
    _rewrite(copy, lambda t: t.__setitem__(name, torch.zeros(5, 64, dtype=torch.bfloat16)))
    with pytest.raises(
        CheckpointError, match=r"q_proj.weight: expected shape \[128, 64\], found \[5, 64\]"
    ):
        load_model(copy)


def test_router_in_bf16_is_refused(copy):
    name = "model.layers.3.mlp.gate.weight"
    _rewrite(copy, lambda t: t.__setitem__(name, t[name].to(torch.bfloat16)))
    with pytest.raises(CheckpointError, match=r"mlp.gate.weight: expected dtype F32, found BF16"):
        load_model(copy)


def test_integer_weight_is_refused(copy):
    name = "model.norm.weight"
    _rewrite(copy, lambda t: t.__setitem__(name, torch.ones(64, dtype=torch.int32)))
    with pytest.raises(CheckpointError, match="model.norm.weight: expected dtype one of"):
        load_model(copy)


def test_unknown_layer_type(copy):
    cfg = json.loads((copy / "config.json").read_text())
    cfg["layer_types"][2] = "linear_attention"
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match=r"layer_types contains unknown type\(s\) \['linear_attention'\]"
    ):
        load_model(copy)


def test_truncated_safetensors(copy):
    f = copy / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_model(copy)(torch.tensor([[1, 2]]))


def test_missing_weights_file(copy):
    (copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        load_model(copy)


def test_config_round_trips_through_transformers(tmp_path):
    from transformers import BeamConfig as HFBeamConfig

    for name in ("tiny", "beam-1.0-501b"):
        cfg = preset(name)
        cfg.save(tmp_path / "config.json")
        hf = HFBeamConfig.from_pretrained(tmp_path)
        ours = BeamConfig.load(tmp_path)
        assert ours == cfg
        hf_dict = hf.to_dict()
        for key, value in cfg.to_dict().items():
            if key in ("architectures", "model_type"):
                continue
            assert hf_dict[key] == value, key
        hf.save_pretrained(tmp_path / "hf")
        assert BeamConfig.load(tmp_path / "hf") == cfg


def test_released_defaults():
    cfg = preset("beam-1.0-501b")
    assert cfg.layer_types.count("full_attention") == 9 and cfg.num_sliding_layers == 43
    assert [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"] == [
        5,
        11,
        17,
        23,
        29,
        35,
        41,
        47,
        51,
    ]
    assert cfg.mlp_layer_types[:3] == ["dense"] * 3 and cfg.mlp_layer_types[3] == "sparse"
    assert cfg.rope_parameters["full_attention"] is None


@pytest.mark.parametrize(
    "tp,heads,kv,replicas,vocab,moe_i",
    [
        (1, 48, 8, 1, 151936, 2560),
        (2, 24, 4, 1, 75968, 1280),
        (8, 6, 1, 1, 18992, 320),
        (16, 3, 1, 2, 9496, 160),
    ],
)
def test_shard_view(tp, heads, kv, replicas, vocab, moe_i):
    s = preset("beam-1.0-501b").shard(tp)
    assert (s.num_attention_heads, s.num_key_value_heads, s.kv_replicas) == (heads, kv, replicas)
    assert (s.vocab_size, s.moe_intermediate_size, s.num_experts) == (vocab, moe_i, 256)
    ep = preset("beam-1.0-501b").shard(8, ep=8)
    assert (ep.num_experts, ep.moe_intermediate_size) == (32, 2560)


def test_shard_view_refuses_uneven_splits():
    with pytest.raises(ValueError, match="tp=5 must divide num_attention_heads=48"):
        preset("beam-1.0-501b").shard(5)
