"""Targets: shipped TOMLs load, shapes derive from the config and contracts, errors are clear."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from autoopt import env
from autoopt.cli import app
from autoopt.profiler.rank import kv_bytes, plan_layers, weight_bytes
from autoopt.targets import (
    TargetError,
    gpu_matches,
    list_targets,
    load_target,
    target_from_dict,
)
from model.config import preset
from model.ops import CONTRACTS

SHIPPED = ["cpu-tiny", "gb200-tp8-decode", "gb200-tp8-prefill", "h200-tp2-decode",
           "h200-tp8-decode", "h200-tp8-prefill"]
runner = CliRunner()


def _valid() -> dict:
    return {"name": "t", "model": "tiny", "phase": "decode", "batch_sizes": [1, 3],
            "contexts": [40], "hardware": {"gpu": "cpu", "arch": "cpu", "hbm_tb_s": 1.0,
                                           "bf16_tflop_s": 1.0, "fp32_tflop_s": 1.0,
                                           "memory_gb": 1.0},
            "parallel": {"tp": 1, "ep": 1}}


def test_shipped_targets_load():
    assert list_targets() == SHIPPED
    for name in SHIPPED:
        t = load_target(name)
        assert t.name == name and t.source == env.tasks_dir() / f"{name}.toml"
    h200 = load_target("h200-tp8-decode")
    assert (h200.hardware.arch, h200.tp, h200.phase) == ("sm_90", 8, "decode")
    assert load_target("gb200-tp8-prefill").hardware.arch == "sm_100"


def test_load_by_path(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text((env.tasks_dir() / "cpu-tiny.toml").read_text().replace(
        'name = "cpu-tiny"', 'name = "mine"'))
    assert load_target(path).name == "mine"
    assert load_target(str(path)).source == path


@pytest.mark.parametrize("batch", [1, 17, 123])
def test_op_shapes_derive_from_config_and_contracts(batch):
    t = load_target("h200-tp8-decode")
    cfg = preset("beam-1.0-501b")
    shard = cfg.shard(8)
    shapes = t.op_shapes(batch)
    for op in ("rmsnorm", "qkv_gate_proj", "router", "moe_experts", "attn_output_gate"):
        assert shapes[op] == CONTRACTS[op].shapes_for(cfg, batch, shard)
    assert shapes["qkv_gate_proj"]["Hq"] == 48 // 8 and shapes["qkv_gate_proj"]["Hkv"] == 1
    # The shapes of the ops the served step calls: under TP8 the boundary is the fused op; decode
    # attention is one paged call per layer over every sequence (one query each).
    assert shapes["allreduce_norm_residual_norm"] == {"R": 8, "T": batch, "H": 5120}
    assert "norm_residual_norm" not in shapes
    att = shapes["attention"]
    assert (att["T"], att["B"], att["Hq"], att["Hkv"], att["W"]) == (batch, batch, 6, 1, 0)
    assert att["S"] >= 100000  # the keys a row's pages hold


@pytest.mark.parametrize("batch", [1, 17, 123])
def test_step_calls_follow_the_layer_structure(batch):
    t = load_target("cpu-tiny")
    cfg = t.config()
    counts: dict[str, int] = {}
    for c in t.step_calls(batch):
        counts[c.name] = counts.get(c.name, 0) + c.count
    n = cfg.num_hidden_layers
    dense = cfg.mlp_layer_types.count("dense")
    assert counts["norm_residual_norm"] == 2 * n
    assert counts["attention"] == n  # one call per layer over every sequence
    assert counts["qk_norm_rope"] + counts["qk_norm_ssmax"] == n
    assert counts["qk_norm_ssmax"] == cfg.layer_types.count("full_attention")
    assert (counts["swiglu"], counts["moe_experts"], counts["router"]) == (dense, n - dense,
                                                                           n - dense)
    assert counts["rmsnorm"] == counts["logit_softcap"] == 1


def test_prefill_tokens_and_layer_proxy():
    t = load_target("h200-tp8-prefill")
    assert t.tokens(8) == 8 * 2048
    shapes = t.op_shapes(8)
    assert shapes["rmsnorm"]["T"] == 8 * 2048 and shapes["logit_softcap"]["T"] == 8
    assert shapes["attention"]["T"] == 8 * 2048 and shapes["attention"]["B"] == 8
    assert shapes["attention"]["S"] == 2048
    assert t.config(6).num_hidden_layers == 6
    assert load_target("h200-tp2-decode").default_layers == 12


def test_full_tp8_rank_fits_one_h200():
    # ~125.6 GB of BF16 weights (+ FP32 routers) per TP8 rank: it fits 141 GB with the cache of
    # 32 sequences of 100k keys, not of 64.
    t = load_target("h200-tp8-decode")
    w = weight_bytes(t, 52)
    assert 120e9 < w < 130e9
    # Sliding layers hold a window plus the pages it straddles.
    assert kv_bytes(t, 32, 100000, 52) == 2 * 2 * 32 * (9 * 100000 + 43 * (512 + 32)) * 1 * 128
    free = int(150e9)  # an H200 as torch reports it before the model is built
    assert plan_layers(t, 32, 100000, free)[0] == 52
    n, why = plan_layers(t, 64, 100000, free)
    assert 4 <= n < 52 and "of 52 layers" in why
    with pytest.raises(TargetError, match="lower --batch"):
        plan_layers(t, 64, 100000, int(5e9))


@pytest.mark.parametrize("change, message", [
    ({"phase": "training"}, "phase 'training'"),
    ({"batch_sizes": []}, "batch_sizes must be"),
    ({"batch_sizes": [0]}, "batch_sizes must be"),
    ({"contexts": [-5]}, "contexts must be"),
    ({"bogus": 1}, "unknown key(s) ['bogus']"),
    ({"model": "beam-2"}, "unknown preset 'beam-2'"),
    ({"parallel": {"tp": 3}}, "tp=3 must divide num_attention_heads"),
    ({"parallel": {"tp": 1, "pp": 2}}, "unknown key(s) ['pp'] in [parallel]"),
    ({"layers": 99}, "layers=99 must be within 1..8"),
    ({"hardware": {"gpu": "x"}}, "missing required key(s)"),
])
def test_invalid_targets_say_what_is_wrong(change, message):
    data = {**_valid(), **change}
    with pytest.raises(TargetError) as err:
        target_from_dict(data)
    assert message in str(err.value)


def test_bad_arch_and_rates():
    data = _valid()
    data["hardware"] = {**data["hardware"], "arch": "hopper"}
    with pytest.raises(TargetError, match="should look like sm_90"):
        target_from_dict(data)
    data["hardware"] = {**_valid()["hardware"], "hbm_tb_s": 0}
    with pytest.raises(TargetError, match="hardware.hbm_tb_s must be positive"):
        target_from_dict(data)


def test_unknown_target_and_bad_toml(tmp_path):
    with pytest.raises(TargetError, match="known targets: cpu-tiny, gb200"):
        load_target("h300-tp8-decode")
    bad = tmp_path / "bad.toml"
    bad.write_text("name = [unclosed\n")
    with pytest.raises(TargetError, match="is not valid TOML"):
        load_target(bad)


def test_gpu_matching():
    assert gpu_matches("NVIDIA H200", "NVIDIA H200")
    assert gpu_matches("NVIDIA H200", "NVIDIA H200 NVL")
    assert not gpu_matches("NVIDIA H200", "NVIDIA H100 80GB HBM3")
    assert not gpu_matches("NVIDIA GB200", "NVIDIA B200")


def test_gpu_absent_refused_unless_proxy(monkeypatch):
    t = load_target("h200-tp8-decode")
    assert load_target("cpu-tiny").require_local_gpu() is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(TargetError, match="needs a CUDA GPU .*cpu-tiny"):
        t.require_local_gpu()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    with pytest.raises(TargetError, match="pass --proxy"):
        t.require_local_gpu(proxy=False)
    assert t.require_local_gpu(proxy=True) == ("proxy for h200-tp8-decode measured on "
                                               "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    assert t.require_local_gpu(proxy=True) is None  # the right GPU: not a proxy


def test_cli_targets():
    result = runner.invoke(app, ["targets"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for name in SHIPPED:
        assert name in result.output
    result = runner.invoke(app, ["targets", "h200-tp8-decode", "--batch", "17"],
                           env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "moe_experts" in result.output and "T=17" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine w/o GPU")
def test_cli_profile_refuses_absent_gpu():
    result = runner.invoke(app, ["profile", "--target", "h200-tp8-decode"],
                           env={"COLUMNS": "200"})
    assert result.exit_code == 2
    assert "needs a CUDA GPU" in result.output
