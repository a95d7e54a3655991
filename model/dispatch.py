"""Runtime dispatch: a locked registry variant becomes a callable the OpTable holds.

`load_locked` checks a lock entry against the file on disk (present, same sha256, recorded and
declared archs) and executes exactly the bytes it hashed; `KernelCall` then passes each call the
tuned config of its token bucket on this GPU. Every failure is returned as a reason, never
raised: the caller (model.registry.resolve_ops) warns once and keeps the reference.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import sys
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .ops import contract

if TYPE_CHECKING:
    from .registry import LockEntry, Registry

log = logging.getLogger("model.registry")
BUCKET = re.compile(r"^T=(\d+)$")
_LOGGED_MISSES: set[tuple[str, str, str]] = set()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class KernelCall:
    """A variant's `run`, called with the tuned config of each call's token bucket on this GPU."""

    def __init__(self, op: str, variant: str, run: Callable[..., Any],
                 buckets: Mapping[str, dict] | None, default: dict | None, source: str) -> None:
        self.op, self.variant, self.run, self.source = op, variant, run, source
        self.token_dim = contract(op).token_dim  # buckets are keyed by T, wherever it sits
        self.default = dict(default) if default is not None else None
        self.buckets = sorted((int(BUCKET.match(k).group(1)), dict(v))
                              for k, v in (buckets or {}).items() if BUCKET.match(k))
        self._by_tokens: dict[int, dict | None] = {}
        self.__module__ = f"kernels.{op}.{variant}"
        self.__name__ = self.__qualname__ = f"{op}[{variant}]"

    def config_for(self, tokens: int) -> dict | None:
        if tokens not in self._by_tokens:
            if not self.buckets:
                cfg = self.default
            else:
                t = math.log2(max(tokens, 1))
                cfg = min(self.buckets, key=lambda b: (abs(math.log2(max(b[0], 1)) - t), b[0]))[1]
            self._by_tokens[tokens] = cfg
        return self._by_tokens[tokens]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else None
        dim = self.token_dim
        tokens = int(first.shape[dim]) if isinstance(first, torch.Tensor) and first.dim() > dim \
            else 0
        return self.run(*args, config=self.config_for(tokens), **kwargs)

    def __repr__(self) -> str:
        return f"KernelCall({self.op}/{self.variant} from {self.source})"


def exec_variant(op: str, name: str, path: Path, source: bytes, sha: str) -> types.ModuleType:
    # Executes exactly the bytes that were hashed; one module per content hash.
    modname = f"_autoopt_kernels.{op}.{name}_{sha[:16]}"
    if modname in sys.modules:
        return sys.modules[modname]
    module = types.ModuleType(modname)
    module.__file__ = str(path)
    sys.modules[modname] = module
    try:
        exec(compile(source, str(path), "exec"), module.__dict__)
    except BaseException:
        sys.modules.pop(modname, None)
        raise
    return module


def uninterpretable(module: types.ModuleType) -> str | None:
    # A compiled (non-interpreter) Triton kernel cannot take CPU tensors.
    jit = sys.modules.get("triton.runtime.jit")
    if jit is None:
        return None
    for value in vars(module).values():
        if isinstance(value, jit.JITFunction):
            return ("its Triton kernels were compiled for a GPU; on the CPU they need "
                    "TRITON_INTERPRET=1 set before triton is imported")
    return None


def load_locked(reg: Registry, op: str, entry: LockEntry, arch: str, gpu: str
                ) -> tuple[KernelCall | None, str]:
    """(callable, "") or (None, why it is refused)."""
    try:
        path = reg.variant_path(op, entry.variant)
    except ValueError as exc:
        return None, str(exc)
    if not path.is_file():
        return None, f"its file {path} is missing"
    data = path.read_bytes()
    sha = sha256_bytes(data)
    if sha != entry.sha256:
        return None, (f"{path} hashes to {sha[:12]}, the lock pins {entry.sha256[:12]}: the file "
                      "changed since it was locked (variants are immutable; lock a new one)")
    try:
        rec = reg.read_record(op, entry.variant) or {}
    except ValueError as exc:
        return None, str(exc)
    archs = rec.get("archs") or []
    if archs and arch not in archs:
        return None, f"it is recorded for arch {', '.join(archs)}, this machine is {arch}"
    try:
        module = exec_variant(op, entry.variant, path, data, sha)
    except (Exception, SystemExit) as exc:  # a broken variant must not take the process down
        return None, f"importing {path} failed: {type(exc).__name__}: {exc}"
    declared = getattr(module, "ARCHS", None)
    if declared and arch not in declared:
        return None, f"it declares ARCHS = {tuple(declared)}, this machine is {arch}"
    run = getattr(module, "run", None)
    if not callable(run):
        return None, f"{path} defines no callable run(...)"
    if arch == "cpu" and (why := uninterpretable(module)):
        return None, why
    try:
        configs = reg.read_configs(op, entry.variant)
    except ValueError as exc:
        return None, str(exc)
    default = getattr(module, "DEFAULT_CONFIG", None)
    buckets = configs.get(gpu, configs.get("*"))
    if configs and buckets is None and (op, entry.variant, gpu) not in _LOGGED_MISSES:
        _LOGGED_MISSES.add((op, entry.variant, gpu))
        log.info("no tuned config for %s/%s on %s; using its DEFAULT_CONFIG", op, entry.variant,
                 gpu)
    source = f"{entry.variant} ({reg.root})"
    return KernelCall(op, entry.variant, run, buckets, default, source), ""
