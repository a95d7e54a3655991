"""Our Beam forward against transformers 5.23's BeamForCausalLM, the oracle."""

from __future__ import annotations

import pytest
import torch

from model import load_model
from model.config import preset

from ._hf import load_hf, save_hf_checkpoint

pytest.importorskip("transformers")

# Two structurally different configs: the tiny preset (8 layers, window 16) and one with other
# head counts, group sizes, RoPE theta, a custom layer pattern and 10 layers (> 6).
CONFIGS = {
    "tiny": preset("tiny"),
    "wide": preset("tiny").replace(
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=10,
        sliding_window=8,
        num_experts=16,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=4,
        moe_intermediate_size=24,
        intermediate_size=80,
        vocab_size=512,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0},
            "full_attention": None,
        },
        layer_types=["sliding_attention", "full_attention"] * 2
        + ["sliding_attention"] * 5
        + ["full_attention"],
        mlp_layer_types=["dense", "dense"] + ["sparse"] * 8,
    ),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    cfg = CONFIGS[request.param]
    path = tmp_path_factory.mktemp(f"hf-{request.param}")
    return cfg, save_hf_checkpoint(cfg, path, seed=len(request.param))


def _ids(cfg, batch, seq, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)


@pytest.mark.parametrize("seq", [1, 7, 41])
def test_fp32_logits_match_transformers(checkpoint, seq):
    cfg, path = checkpoint
    assert seq < cfg.sliding_window or seq > 2 * cfg.sliding_window or seq == 7
    ids = _ids(cfg, 2, seq, seed=seq)
    with torch.no_grad():
        expected = load_hf(path, torch.float32)(ids).logits
    got = load_model(path, dtype=torch.float32)(ids)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    # FP32 end to end; only summation order inside library kernels differs.
    rel = (got - expected).abs().max() / expected.abs().max()
    assert rel < 1e-5, f"relative max error {rel:.2e}"
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_bf16_logits_match_transformers(checkpoint, record_property):
    cfg, path = checkpoint
    ids = _ids(cfg, 3, 2 * cfg.sliding_window + 9, seed=5)  # longer than the window
    with torch.no_grad():
        expected = load_hf(path, torch.bfloat16)(ids).logits
    got = load_model(path, dtype=torch.bfloat16)(ids)
    mismatches = int((got != expected).sum())
    record_property("bf16_logit_mismatches", f"{mismatches}/{got.numel()}")
    # Same rounding points as the reference, op by op. On this CPU build it is bitwise (0
    # mismatches); a BLAS that orders a GEMM's K loop differently for our per-sequence or
    # per-expert shapes could move a few logits, so allow 0.1% within the op policies.
    assert mismatches <= got.numel() * 1e-3, f"{mismatches} of {got.numel()} logits differ"
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_sharded_checkpoint_loads_the_same(tmp_path):
    cfg = CONFIGS["tiny"]
    single = save_hf_checkpoint(cfg, tmp_path / "single", seed=3)
    sharded = save_hf_checkpoint(cfg, tmp_path / "sharded", seed=3, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    ids = _ids(cfg, 1, 12, seed=1)
    a = load_model(single, dtype=torch.float32)(ids)
    b = load_model(sharded, dtype=torch.float32)(ids)
    assert torch.equal(a, b)


def test_demo_checkpoint_round_trips_through_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from model.demo import write_demo_checkpoint

    path = write_demo_checkpoint(tmp_path / "demo", "tiny", seed=11)
    ids = _ids(preset("tiny"), 2, 37, seed=2)
    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", experts_implementation="grouped_mm"
    )
    with torch.no_grad():
        expected = hf(ids).logits
    got = load_model(path, dtype=torch.float32)(ids)
    assert (got - expected).abs().max() / expected.abs().max() < 1e-5
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
