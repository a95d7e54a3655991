"""Loading a kernel variant file as a module, by path.

A variant is a Python file exporting `run(*args, config=None)` with its op's reference signature
(argument order of `model/ops/<op>.py` SIGNATURE), and optionally `CONFIG_SPACE` (name -> list of
values) and `DEFAULT_CONFIG`. Variant files live in a registry directory (`<dir>/<op>/<name>.py`),
which is not an import package: they are loaded from their path under a unique private module
name, without touching `sys.path`, so two variants with the same file name never collide and a
variant cannot shadow a real package.
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

_COUNTER = itertools.count()
_NAME_OK = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Variant:
    """A loaded variant: its module, entry point and tuning space."""

    path: Path
    sha256: str
    module: ModuleType
    run: Callable[..., Any]
    config_space: Mapping[str, list] = field(default_factory=dict)
    default_config: Mapping[str, Any] | None = None

    @property
    def name(self) -> str:
        return self.path.stem


def sha256_file(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def variant_path(op: str, name: str, registry: Path) -> Path:
    """`<registry>/<op>/<name>.py`, checked to exist, with a message naming what is there."""
    if not _NAME_OK.match(name):
        raise ValueError(f"variant name {name!r} must be a Python identifier (the file is "
                         f"<registry>/<op>/<name>.py)")
    path = Path(registry) / op / f"{name}.py"
    if not path.is_file():
        folder = path.parent
        known = sorted(p.stem for p in folder.glob("*.py")) if folder.is_dir() else []
        raise FileNotFoundError(
            f"no variant {name!r} for op {op!r}: {path} does not exist; "
            f"variants there: {', '.join(known) or 'none'} (pass --registry DIR or --source PATH)"
        )
    return path


def load_variant(path: Path, *, module_name: str | None = None) -> Variant:
    """Execute the variant file as a fresh module and check its entry point.

    The module is registered in `sys.modules` under a unique private name (dataclasses, pickling
    and Triton's source lookup want a module object to exist); `sys.path` is never changed.
    Raises ValueError when `run` is missing or `CONFIG_SPACE` is malformed, and lets the
    variant's own import error propagate. For trusted code (the built-in templates, the
    registry's loader); a candidate under judgement is loaded by its worker (worker.py).
    """
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"variant file {path} does not exist")
    digest = sha256_file(path)
    name = module_name or f"_autoopt_variant_{path.stem}_{digest[:12]}_{next(_COUNTER)}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot load {path} as a Python module (expected a .py file)")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    run = getattr(module, "run", None)
    if not callable(run):
        raise ValueError(f"{path} must define run(*args, config=None) with the op's signature; "
                         f"it defines no callable `run`")
    space = getattr(module, "CONFIG_SPACE", {}) or {}
    if not isinstance(space, Mapping) or not all(
        isinstance(k, str) and isinstance(v, list | tuple) and len(v) > 0 for k, v in space.items()
    ):
        raise ValueError(f"{path}: CONFIG_SPACE must map parameter names to non-empty lists of "
                         f"values, got {space!r}")
    default = getattr(module, "DEFAULT_CONFIG", None)
    if default is not None and not isinstance(default, Mapping):
        raise ValueError(f"{path}: DEFAULT_CONFIG must be a dict, got {type(default).__name__}")
    return Variant(path=path, sha256=digest, module=module, run=run,
                   config_space={k: list(v) for k, v in space.items()},
                   default_config=dict(default) if default is not None else None)
