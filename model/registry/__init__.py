"""The kernel registry: one package owns the manifest (records, tuned configs, the lock).

    names.py      RegistryError, KernelRefusedWarning, name and hash checks
    languages.py  kernel languages (triton, cute, torch, library): a Protocol + name registry;
                  a variant's LANGUAGE / LIBRARY / ARCHS read statically
    configs.py    ConfigKey (GPU, the op's fixed per-rank dims, token bucket), ConfigTable and
                  the one nearest-bucket rule
    schema.py     Variant, Provenance, Verification, Benchmark, Record (schema 2)
    lock.py       LockEntry (variant, file sha256, configs sha256), Lock
    store.py      Registry: one directory, safe reads, raw writes
    writers.py    register, tune, record, accept, reject, set_status, lock, unlock, note
    runtime.py    resolve_ops: a lock section -> OpTable, loading only on evidence
    migrate.py    schema 1 -> 2
    paths.py      the default registry (the checkout's kernels/, or the wheel's copy)

The serving runtime needs `resolve_ops` only; the toolkit (autoopt) reads and writes through
`Registry` and `writers`. Nothing here imports autoopt.
"""

from __future__ import annotations

from . import writers
from .configs import ConfigEntry, ConfigKey, ConfigTable
from .languages import LANGUAGES, Language, read_declarations
from .lock import LOCK_NAME, Lock, LockEntry
from .names import KernelRefusedWarning, RegistryError, sha256_bytes
from .paths import shipped_root
from .runtime import KernelCall, Resolution, current_arch, gpu_name, resolve_ops
from .schema import SCHEMA, STATUSES, Benchmark, Provenance, Record, Variant, Verification
from .store import Problem, Registry

sha256 = Registry.sha256


__all__ = ["LANGUAGES", "LOCK_NAME", "SCHEMA", "STATUSES", "Benchmark", "ConfigEntry",
           "ConfigKey", "ConfigTable", "KernelCall", "KernelRefusedWarning", "Language", "Lock",
           "LockEntry", "Problem", "Provenance", "Record", "Registry", "RegistryError",
           "Resolution", "Variant", "Verification", "current_arch", "gpu_name",
           "read_declarations", "resolve_ops", "sha256", "sha256_bytes", "shipped_root",
           "writers"]
