"""Every environment variable autoopt reads, and where its data lives by default, in one place."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

# The directory above the packages: the clone in a source checkout, site-packages when installed
# (child processes get it on PYTHONPATH so they import this autoopt).
REPO_ROOT = Path(__file__).resolve().parent.parent


def _get(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


def triton_interpret() -> bool:
    """Triton kernels run on CPU tensors through the interpreter (tests, cpu-tiny)."""
    return _get("TRITON_INTERPRET", "0") == "1"


def enable_triton_interpreter() -> None:
    """Run Triton kernels on CPU tensors from now on (read by triton at each @triton.jit)."""
    os.environ["TRITON_INTERPRET"] = "1"


def data_dir() -> Path:
    """Per-user data (the user's registry, runs, targets): $XDG_DATA_HOME/autoopt, else
    ~/.local/share/autoopt. Never inside site-packages."""
    base = _get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "autoopt"


def _checkout() -> Path | None:
    from model.registry.paths import checkout_root

    return checkout_root()


def registry_dir() -> Path:
    """The registry commands read and write: $AUTOOPT_REGISTRY; in a source checkout its
    kernels/ (model.registry.paths defines it); installed, the per-user registry."""
    explicit = _get("AUTOOPT_REGISTRY")
    if explicit:
        return Path(explicit)
    from model.registry.paths import shipped_root

    return shipped_root() if _checkout() is not None else data_dir() / "registry"


def registry_seed() -> Path | None:
    """What the per-user registry is copied from on its first write (the registry shipped in
    the wheel, read-only); None when the registry is explicit or the checkout's."""
    if _get("AUTOOPT_REGISTRY") or _checkout() is not None:
        return None
    from model.registry.paths import shipped_root

    return shipped_root()


def open_registry(explicit: str | Path | None = None):  # -> model.registry.Registry
    """The registry a command works on: `--registry DIR` when given, else registry_dir() (which
    reads the shipped registry until the user's first write)."""
    from model.registry import Registry

    if explicit is not None:
        return Registry(explicit)
    return Registry(registry_dir(), seed=registry_seed())


def runs_dir() -> Path:
    """$AUTOOPT_RUNS_DIR; the checkout's runs/; installed, the per-user data directory."""
    explicit = _get("AUTOOPT_RUNS_DIR")
    if explicit:
        return Path(explicit)
    repo = _checkout()
    return repo / "runs" if repo is not None else data_dir() / "runs"


def shipped_tasks_dir() -> Path:
    """The targets that come with autoopt: the checkout's tasks/, or the wheel's copy."""
    repo = _checkout()
    return repo / "tasks" if repo is not None else Path(__file__).parent / "_shipped" / "tasks"


def tasks_dirs() -> list[Path]:
    """Where targets are looked up by name, first match wins: $AUTOOPT_TASKS alone when set,
    else the user's (data_dir()/tasks) and then the shipped ones."""
    explicit = _get("AUTOOPT_TASKS")
    if explicit:
        return [Path(explicit)]
    return [data_dir() / "tasks", shipped_tasks_dir()]


def tasks_dir() -> Path:
    """The primary tasks directory ($AUTOOPT_TASKS, else the shipped targets)."""
    explicit = _get("AUTOOPT_TASKS")
    return Path(explicit) if explicit else shipped_tasks_dir()


def cuda_visible_devices() -> str | None:
    """CUDA_VISIBLE_DEVICES as this process was started with (a pinned worker's GPU)."""
    return _get("CUDA_VISIBLE_DEVICES")


def pin_cuda_device(index: str) -> None:
    """Make GPU `index` this process's only (cuda:0); call before CUDA starts. Children the
    process spawns (the judge's sandboxed workers) inherit it."""
    os.environ["CUDA_VISIBLE_DEVICES"] = str(index)


def ray_local_environment() -> dict[str, str]:
    """Environment for a Ray cluster started on this machine for one run (set before `ray` is
    imported): every Ray server bound to loopback (Ray's single-machine mode), no usage stats."""
    return {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


AF_UNIX_PATH_MAX = 107  # bytes of a Unix socket path on Linux (sun_path, less its NUL)


def socket_safe_tmpdir(suffix_len: int) -> str | None:
    """A new temp dir under /tmp for a server that puts Unix sockets `suffix_len` characters below
    its temp dir (Ray's session, Chromium's singleton), or None when the default temp dir is short
    enough. Under a long TMPDIR such servers fail to start ("socket path too long"); None too
    where /tmp cannot take a directory, and the server's own error then says why."""
    if len(tempfile.gettempdir()) + suffix_len <= AF_UNIX_PATH_MAX:
        return None
    try:
        return tempfile.mkdtemp(prefix="autoopt-", dir="/tmp")
    except OSError:
        return None


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


def terminal_columns() -> int | None:
    """COLUMNS when the caller set it (rich honours it; autoopt.console only asks whether)."""
    value = _get("COLUMNS")
    return int(value) if value and value.isdigit() else None
