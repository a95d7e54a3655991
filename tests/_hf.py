"""Helpers shared by the model tests: transformers-written checkpoints and ulp distances."""

from __future__ import annotations

from pathlib import Path

import torch

from model.config import BeamConfig


def hf_config(cfg: BeamConfig):
    from transformers import BeamConfig as HFBeamConfig

    data = cfg.to_dict()
    for key in ("architectures", "model_type", "dtype"):
        data.pop(key, None)
    return HFBeamConfig(**data)


def save_hf_checkpoint(cfg: BeamConfig, path: Path, seed: int, **save_kwargs) -> Path:
    """A random checkpoint written by transformers' own `save_pretrained`, with non-trivial
    gate_bias, e_score_correction_bias and norm weights (zeros/ones would hide mistakes)."""
    from transformers import BeamForCausalLM as HFBeam

    torch.manual_seed(seed)
    model = HFBeam(hf_config(cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("gate_bias"):
                p.normal_(0.0, 1.0)
            elif p.dim() >= 2:
                p.normal_(0.0, 0.08)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.05)
    model.save_pretrained(path, **save_kwargs)
    return path


def load_hf(path: Path, dtype: torch.dtype):
    from transformers import BeamForCausalLM as HFBeam

    # Pinned per docs/numerics.md: eager attention and the grouped_mm experts backend.
    return HFBeam.from_pretrained(
        path, dtype=dtype, attn_implementation="eager", experts_implementation="grouped_mm"
    ).eval()


def bf16_ulp(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in BF16 ulps between two BF16 tensors (monotone integer mapping of the bits)."""

    def key(x):
        i = x.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -32768 - i, i)

    return (key(a) - key(b)).abs()
