"""The runtime's view of a registry: a lock section becomes the model's OpTable.

`resolve_ops` reads the lock section of this machine's arch and loads each entry only on
evidence (`load_locked`): the variant file is a regular file inside the registry whose sha256 is
the lock's; an accepted record verified exactly those bytes on this arch; the file's language can
run here (and its pinned library is the one installed); its tuned configs hash to what the lock
pins. Anything else is refused with one KernelRefusedWarning naming why, and the op runs the
reference; `table.resolution[op]` says per op. A missing arch section means the reference
everywhere, never another arch's code. `KernelCall` hands each call the tuned config of its key
(GPU, the op's fixed dims read from the call's arguments, nearest token bucket).
"""

from __future__ import annotations

import logging
import sys
import types
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from model.ops import CONTRACTS, OpTable

from .configs import ConfigTable, call_axes
from .languages import language, library_problem
from .lock import LOCK_NAME, LockEntry
from .names import KernelRefusedWarning, RegistryError
from .schema import Variant
from .store import Registry

log = logging.getLogger("model.registry")
_LOGGED_MISSES: set[tuple[str, str, str, tuple]] = set()


def current_arch(device: str | torch.device | None = None) -> str:
    """`sm_<major><minor>` of the CUDA device the model runs on, `cpu` otherwise."""
    dev = torch.device(device) if device is not None else None
    if dev is None:
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type != "cuda" or not torch.cuda.is_available():
        return "cpu"
    major, minor = torch.cuda.get_device_capability(dev)
    return f"sm_{major}{minor}"


def gpu_name(device: str | torch.device | None = None) -> str:
    """The name tuned configs are keyed by: torch's device name, or `cpu`."""
    if current_arch(device) == "cpu":
        return "cpu"
    dev = torch.device(device) if device is not None else torch.device("cuda")
    return torch.cuda.get_device_name(dev)


def exec_variant(op: str, name: str, path: Path, source: bytes, sha: str) -> types.ModuleType:
    """Execute exactly the bytes that were hashed; one module per content hash."""
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


class KernelCall:
    """A variant's `run`, called with the tuned config of each call's key on this GPU."""

    def __init__(self, op: str, variant: str, run: Callable[..., Any], configs: ConfigTable,
                 gpu: str, default: Mapping | None, source: str) -> None:
        self.op, self.variant, self.run, self.source = op, variant, run, source
        self.configs, self.gpu = configs, gpu
        self.default = dict(default) if default is not None else None
        self._fixed, self._token = call_axes(op)
        self._by_shapes: dict[tuple, dict | None] = {}
        self.__module__ = f"kernels.{op}.{variant}"
        self.__name__ = self.__qualname__ = f"{op}[{variant}]"

    def config_for(self, tokens: int, dims: tuple[tuple[str, int], ...] = ()) -> dict | None:
        cfg = self.configs.lookup(self.gpu, dims, tokens)
        if cfg is None:
            key = (self.op, self.variant, self.gpu, dims)
            if self.configs and key not in _LOGGED_MISSES:
                _LOGGED_MISSES.add(key)
                log.info("no tuned config for %s/%s on %s at %s; using its DEFAULT_CONFIG",
                         self.op, self.variant, self.gpu, dict(dims) or "these dims")
            return self.default
        return dict(cfg)

    def key_of(self, args: tuple) -> tuple[int, tuple[tuple[str, int], ...]]:
        """(tokens, fixed dims) of one call, read from its tensor arguments."""
        def size(i: int, axis: int) -> int | None:
            a = args[i] if i < len(args) else None
            return int(a.shape[axis]) if isinstance(a, torch.Tensor) and a.dim() > axis else None

        tokens = size(*self._token) if self._token else None
        dims = tuple(sorted((name, s) for i, axis, name in self._fixed
                            if (s := size(i, axis)) is not None))
        return tokens or 0, dims

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
        if shapes not in self._by_shapes:
            self._by_shapes[shapes] = self.config_for(*self.key_of(args))
        cfg = self._by_shapes[shapes]
        # A copy per call: a variant that edits its config cannot change the next call's.
        return self.run(*args, config=dict(cfg) if cfg is not None else None, **kwargs)

    def __repr__(self) -> str:
        return f"KernelCall({self.op}/{self.variant} from {self.source})"


def check_evidence(reg: Registry, op: str, entry: LockEntry, arch: str,
                   allow_candidates: bool = False) -> tuple[Variant, bytes, ConfigTable] | str:
    """(variant, bytes, configs) when the lock entry's evidence holds, else why not: the file is
    safe and is the locked bytes, an accepted record verified them on `arch`, and the configs
    are the pinned ones. (What this machine can run is `machine_problem`'s question.)"""
    try:
        variant, data = reg.read_variant(op, entry.variant)
        rec = reg.read_record(op, entry.variant)
    except RegistryError as exc:
        return str(exc)
    if variant.sha256 != entry.sha256:
        return (f"{op}/{entry.variant}.py hashes to {variant.sha256[:12]}, the lock pins "
                f"{entry.sha256[:12]}: the file changed since it was locked (variants are "
                "immutable; lock a new one)")
    if rec is None:
        return f"it has no record in {reg.root}: it was never verified or reviewed"
    allowed = ("accepted", "candidate") if allow_candidates else ("accepted",)
    if rec.status not in allowed:
        return f"its record is {rec.status!r}, not accepted"
    if not rec.verified(arch, variant.sha256):
        return (f"its record has no passing verification of these bytes on {arch} "
                f"(verdict there: {rec.verdict(arch)}; recorded sha256 "
                f"{rec.variant.sha256[:12]})")
    if variant.archs and arch not in variant.archs:
        return f"it declares ARCHS = {variant.archs}, this machine is {arch}"
    try:
        configs = (reg.read_configs(op, entry.variant) if rec.status == "accepted"
                   else rec.proposed_configs)
    except RegistryError as exc:
        return str(exc)
    if configs.sha256 != entry.configs_sha256:
        return (f"its tuned configs hash to {configs.sha256[:12]}, the lock pins "
                f"{entry.configs_sha256[:12]}: configs changed since it was locked")
    return variant, data, configs


def machine_problem(variant: Variant, arch: str) -> str | None:
    """Why this machine cannot run `variant` on `arch` (toolchain, library, no CPU path)."""
    why = language(variant.language).unavailable(arch) or (
        library_problem(variant.library) if variant.library else None)
    if why is None and arch == "cpu" and not variant.runs_on_cpu:
        why = f"a {variant.language} variant that does not run on the CPU"
    return why


def load_locked(reg: Registry, op: str, entry: LockEntry, arch: str, gpu: str,
                allow_candidates: bool = False) -> tuple[KernelCall | None, str]:
    """(callable, "") or (None, why it is refused); never raises for the variant's faults."""
    found = check_evidence(reg, op, entry, arch, allow_candidates)
    if isinstance(found, str):
        return None, found
    variant, data, configs = found
    why = machine_problem(variant, arch)
    if why:
        return None, why
    path = reg.variant_path(op, entry.variant)
    try:
        module = exec_variant(op, entry.variant, path, data, variant.sha256)
    except (Exception, SystemExit) as exc:  # a broken variant must not take the process down
        return None, f"importing {op}/{entry.variant}.py failed: {type(exc).__name__}: {exc}"
    run = getattr(module, "run", None)
    if not callable(run):
        return None, f"{op}/{entry.variant}.py defines no callable run(...)"
    why = language(variant.language).not_runnable(module, arch)
    if why:
        return None, why
    default = getattr(module, "DEFAULT_CONFIG", None)
    return KernelCall(op, entry.variant, run, configs, gpu, default,
                      f"{entry.variant} ({reg.root})"), ""


@dataclass(frozen=True)
class Resolution:
    """How one op was resolved: `source` is what OpTable.sources shows; `refused` says why not."""

    op: str
    source: str
    variant: str | None = None
    refused: str | None = None


def recorded_entry(reg: Registry, op: str, variant: str) -> LockEntry | str:
    """A lock entry for a recorded variant (its file hash and configs: the accepted table, or a
    candidate's proposed one), or why there is none. Loading it still runs every check a locked
    variant passes (`load_locked`)."""
    try:
        if not reg.variant_path(op, variant).is_file():
            return f"the registry {reg.root} has no {op}/{variant}.py"
        rec = reg.read_record(op, variant)
        if rec is None:
            return f"{op}/{variant} has no record (record it before running it)"
        configs = reg.read_configs(op, variant) if rec.status == "accepted" \
            else rec.proposed_configs
        return LockEntry(variant, rec.variant.sha256, configs.sha256)
    except (RegistryError, ValueError) as exc:
        return str(exc)


def load_recorded(reg: Registry, op: str, variant: str,
                  device: str | torch.device | None) -> tuple[Callable | None, str | None]:
    """(the callable, None) for a recorded variant that may run on `device`'s arch (verified
    there, file and configs as recorded, runnable on this machine), or (None, why not)."""
    found = recorded_entry(reg, op, variant)
    if isinstance(found, str):
        return None, found
    arch = current_arch(device)
    why = machine_problem(reg.read_variant(op, variant)[0], arch)
    if why is not None:
        return None, why
    return load_locked(reg, op, found, arch, gpu_name(device) if arch != "cpu" else "cpu",
                       allow_candidates=True)


def _lock_entries(reg: Registry, kernels: str | Path, arch: str) -> dict[str, LockEntry]:
    path = reg.lock_path if str(kernels) == "tuned" else Path(kernels)
    if str(kernels) != "tuned" and not path.is_file():
        raise RegistryError(f"--kernels {kernels}: no such lock file (use tuned, reference or "
                            "the path of a registry.lock.toml)")
    if not path.is_file():
        log.info("no lock file at %s: every op runs the reference", path)
        return {}
    try:
        lock = reg.read_lock(path)
    except RegistryError as exc:
        warnings.warn(f"{exc}; every op runs the reference", KernelRefusedWarning, stacklevel=3)
        return {}
    for problem in lock.problems:
        warnings.warn(f"{problem}; ignoring it", KernelRefusedWarning, stacklevel=3)
    if arch not in lock.sections:
        log.info("lock %s has no [%s] section: every op runs the reference", path, arch)
    return dict(lock.section(arch))


COMPILE_SUFFIX = "+compile"


def _own_registry(lock: Path) -> bool:
    """A registry.lock.toml beside op folders: the lock of that registry (a copy of kernels/)."""
    return lock.name == LOCK_NAME and any((lock.parent / op).is_dir() for op in CONTRACTS)


def resolve_ops(kernels: str | Path = "tuned", registry: str | Path | Registry | None = None,
                arch: str | None = None, device: str | torch.device | None = None,
                dtype: torch.dtype | None = None, allow_candidates: bool = False) -> OpTable:
    """The OpTable for `--kernels tuned|reference|<lock file>` on this machine.

    `tuned` reads the registry's own lock, a path reads that lock file (variants and evidence
    still come from `registry`, default: registry.paths.shipped_root()), except that a file
    named registry.lock.toml beside op folders is another registry's own lock, so variants,
    records and configs come from its folder (a copy of kernels/ taken before a change is that
    change's "before", measured beside it in one run). The section is this machine's arch
    (from `device`, or `arch` to override). Variants implement the BF16 contracts: a model of
    another `dtype` runs every reference, said in `table.resolution`.
    `allow_candidates` also loads verified candidates (the optimize loop's trial of a new set;
    never the serving default). A `+compile` suffix (`tuned+compile`, `LOCK+compile`) runs every
    op the set leaves at the reference under torch.compile (model/ops/compiled.py).
    """
    if str(kernels).endswith(COMPILE_SUFFIX) and str(kernels) != COMPILE_SUFFIX:
        from model.ops.compiled import compile_the_rest

        base = str(kernels)[:-len(COMPILE_SUFFIX)]
        table = resolve_ops(base, registry, arch, device, dtype, allow_candidates)
        resolution = getattr(table, "resolution", {})
        table, compiled = compile_the_rest(table)
        table.resolution = resolution
        log.info("--kernels %s: compiled by Inductor: %s", kernels, ", ".join(compiled))
        return table
    if str(kernels) not in ("tuned", "reference") and _own_registry(Path(kernels)):
        registry = Path(kernels).resolve().parent
    reg = registry if isinstance(registry, Registry) else Registry(registry)
    if registry is not None and not reg.root.is_dir():
        raise RegistryError(f"no registry at {reg.root} (a directory of <op>/<variant>.py "
                            "files, records/, configs/ and registry.lock.toml)")
    arch = arch or current_arch(device)
    resolution = {op: Resolution(op, "reference") for op in CONTRACTS}
    entries = {} if str(kernels) == "reference" else _lock_entries(reg, kernels, arch)
    if dtype is not None and dtype != torch.bfloat16 and entries:
        why = f"registry variants implement the BF16 contracts; a {dtype} model runs the reference"
        log.info("--kernels %s: %s", kernels, why)
        resolution.update({op: Resolution(op, "reference", e.variant, why)
                           for op, e in entries.items() if op in CONTRACTS})
        entries = {}
    impls: dict[str, Callable] = {}
    gpu = gpu_name(device) if arch != "cpu" else "cpu"
    for op, entry in sorted(entries.items()):
        if op not in CONTRACTS:
            warnings.warn(f"lock [{arch}] names unknown op {op!r}; ignoring it",
                          KernelRefusedWarning, stacklevel=2)
            continue
        call, why = load_locked(reg, op, entry, arch, gpu, allow_candidates)
        if call is None:
            warnings.warn(f"kernel {op}/{entry.variant} refused for {arch}: {why}; {op} runs the "
                          "reference", KernelRefusedWarning, stacklevel=2)
            resolution[op] = Resolution(op, "reference", entry.variant, why)
            continue
        impls[op] = call
        resolution[op] = Resolution(op, call.source, entry.variant)
    table = OpTable(impls, {op: c.source for op, c in impls.items()})
    table.resolution = resolution
    return table
