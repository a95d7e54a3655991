"""A random-weight Beam checkpoint in the exact Hugging Face layout, with a real tokenizer.

Used by `autoopt demo-checkpoint` and by `autoopt serve` without `--model`, so a new user sees
the whole stack work on any machine. Experts are written per expert, as transformers'
`save_pretrained` writes them; the router weight and correction bias are FP32.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from .config import BeamConfig, preset
from .weights import expected_tensors


def random_tensor(
    name: str, shape: tuple[int, ...], g: torch.Generator, std: float
) -> torch.Tensor:
    if name.endswith("norm.weight") or "layernorm" in name:
        # Norm weights near 1 with spread, so a dropped or misplaced weight multiply shows.
        return 1.0 + 0.2 * torch.randn(shape, generator=g)
    if name.endswith("gate_bias"):
        return torch.randn(shape, generator=g)
    if name.endswith("e_score_correction_bias"):
        return 0.05 * torch.randn(shape, generator=g)
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=g)
    return std * torch.randn(shape, generator=g)


def random_state_dict(
    cfg: BeamConfig, seed: int = 0, dtype=torch.bfloat16
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for spec in expected_tensors(cfg):
        t = random_tensor(spec.name, spec.shape, g, cfg.initializer_range * 4)
        out[spec.name] = t.float() if spec.fp32 else t.to(dtype)
    return out


def write_demo_checkpoint(
    path: str | Path, preset_name: str = "tiny", seed: int = 0, config: BeamConfig | None = None
) -> Path:
    """Write config.json, model.safetensors, generation_config.json and the tokenizer files."""
    from .serve.tokenizer import write_tokenizer_files

    cfg = config or preset(preset_name)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg.replace(extra={**cfg.extra, "dtype": "bfloat16"}).save(path / "config.json")
    save_file(
        random_state_dict(cfg, seed), str(path / "model.safetensors"), metadata={"format": "pt"}
    )
    gen = {
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "do_sample": False,
    }
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    write_tokenizer_files(path, cfg.vocab_size)
    return path
