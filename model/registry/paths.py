"""Where the default registry is: the checkout's kernels/, or the copy shipped in the wheel.

In a source checkout (an editable install, or PYTHONPATH at the clone) the repository's
`kernels/` is the default registry and is written in place (`git diff kernels/` shows what a run
or a review changed). An installed wheel carries a copy of it as package data under
`model/registry/_shipped/` (written there by the build, see setup.py); that copy is read-only:
writes go to a registry outside site-packages (`--registry DIR`, `AUTOOPT_REGISTRY`, or the
per-user registry that autoopt seeds from this copy on first write; autoopt/env.py).
"""

from __future__ import annotations

from pathlib import Path

PACKAGE_DATA = Path(__file__).resolve().parent / "_shipped"
_REPO = Path(__file__).resolve().parents[2]


def checkout_root() -> Path | None:
    """The source checkout this package runs from, None when it is installed."""
    if (_REPO / "pyproject.toml").is_file() and (_REPO / "kernels").is_dir():
        return _REPO
    return None


def shipped_root() -> Path:
    """The default registry: the checkout's kernels/, else the copy in the installed package."""
    repo = checkout_root()
    return repo / "kernels" if repo is not None else PACKAGE_DATA


def is_shipped_copy(path: Path) -> bool:
    """`path` is (inside) the read-only copy installed with the package."""
    try:
        return Path(path).resolve().is_relative_to(PACKAGE_DATA)
    except OSError:
        return False
