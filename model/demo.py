"""A random-weight Beam checkpoint in the exact Hugging Face layout, with a real tokenizer.

Used by `autoopt demo-checkpoint` and by `autoopt serve` without `--model`, so a new user sees
the whole stack work on any machine. Experts are written per expert, as transformers'
`save_pretrained` writes them; the router weight and correction bias are FP32.

`ensure_demo_checkpoint` writes the served demo atomically: into a staging directory beside the
target, then one rename, so a process killed half way never leaves a checkpoint that looks
complete; a partial one left by an older writer is detected and rebuilt.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from .config import BeamConfig, preset
from .weights import expected_tensors

log = logging.getLogger(__name__)
DEMO_FILES = frozenset({"config.json", "model.safetensors", "generation_config.json",
                        "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"})
COMPLETE_MARKER = ".complete"  # the last file write_demo_checkpoint writes


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
    (path / COMPLETE_MARKER).write_text("every file of the demo checkpoint is written\n")
    return path


def is_complete_demo(path: Path) -> bool:
    return (path / COMPLETE_MARKER).is_file() and all((path / f).is_file() for f in DEMO_FILES)


def ensure_demo_checkpoint(path: str | Path, preset_name: str = "tiny") -> Path:
    """The demo checkpoint at `path`, written first if it is missing or incomplete.

    Concurrent callers (torchrun ranks) serialize on a lock file beside `path`; the one that
    writes stages into `.<name>.partial-<pid>` and renames it into place.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_complete_demo(path):
            return path
        # Under the lock every staging directory is a dead writer's leftover.
        for stale in path.parent.glob(f".{path.name}.partial-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if path.exists():
            _remove_partial(path)
        staging = path.parent / f".{path.name}.partial-{os.getpid()}"
        write_demo_checkpoint(staging, preset_name)  # its last file is the completion marker
        _fsync_tree(staging)
        os.replace(staging, path)
        _fsync_dir(path.parent)
    return path


def _remove_partial(path: Path) -> None:
    if not path.is_dir():
        raise ValueError(f"{path} exists and is not a directory; remove it or choose another "
                         "demo checkpoint directory")
    names = {p.name for p in path.iterdir()} - {COMPLETE_MARKER, ".lock"}
    foreign = sorted(names - DEMO_FILES)
    if foreign:
        raise ValueError(f"{path} is not a complete demo checkpoint and holds files the demo "
                         f"never writes ({', '.join(foreign[:5])}); remove it or choose another "
                         "demo checkpoint directory")
    log.warning("%s is an incomplete demo checkpoint (an interrupted write); rebuilding it", path)
    shutil.rmtree(path)


def _fsync_tree(path: Path) -> None:
    # Flushed before the rename, so a crash after it cannot leave a named but empty file.
    for file in path.iterdir():
        with open(file, "rb") as f:
            os.fsync(f.fileno())
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    # The rename is durable only once the directories holding the entries are flushed.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
