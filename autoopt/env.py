"""Every environment variable autoopt reads, in one place (prefix AUTOOPT_)."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def _get(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


def triton_interpret() -> bool:
    """Triton kernels run on CPU tensors through the interpreter (tests, cpu-tiny)."""
    return _get("TRITON_INTERPRET", "0") == "1"


def enable_triton_interpreter() -> None:
    """Run Triton kernels on CPU tensors from now on (read by triton at each @triton.jit)."""
    os.environ["TRITON_INTERPRET"] = "1"


def registry_dir() -> Path:
    return Path(_get("AUTOOPT_REGISTRY", str(REPO_ROOT / "kernels")))


def runs_dir() -> Path:
    return Path(_get("AUTOOPT_RUNS_DIR", str(REPO_ROOT / "runs")))


def tasks_dir() -> Path:
    """Where target TOMLs (`<name>.toml`) are looked up by name."""
    return Path(_get("AUTOOPT_TASKS", str(REPO_ROOT / "tasks")))


def ncu_path() -> str | None:
    """An explicit Nsight Compute CLI; unset, `ncu` is looked up on PATH and in CUDA's bin."""
    return _get("AUTOOPT_NCU")


def cache_dir() -> Path:
    """Where measured ceilings and other per-machine facts are cached."""
    return Path(_get("AUTOOPT_CACHE", str(Path.home() / ".cache" / "autoopt")))


def demo_checkpoint_dir() -> Path:
    return Path(_get("AUTOOPT_DEMO_CHECKPOINT", str(cache_dir() / "demo-tiny")))


def serve_api_key() -> str | None:
    """`autoopt serve --api-key` when the flag is not given (keeps the key out of `ps`)."""
    return _get("AUTOOPT_API_KEY") or None


def anthropic_api_key() -> str | None:
    # Read here only; never logged, never written to a run directory.
    return _get("ANTHROPIC_API_KEY")


def anthropic_base_url() -> str | None:
    return _get("ANTHROPIC_BASE_URL")
