"""The kernel registry store and the runtime dispatch that reads it.

A registry is a directory (the repo's `kernels/` by default; any directory works):
    <op>/<variant>.py          a variant: `run(<op args>, config=None)`, optional CONFIG_SPACE,
                               DEFAULT_CONFIG and ARCHS; immutable once recorded
    <op>/records/<variant>.json   provenance, verification, benchmarks, status, the file's sha256
    <op>/configs/<variant>.json   {"<gpu name>": {"T=<tokens>": {config}}}, nearest bucket wins
    registry.lock.toml         [<arch>] op = { variant = "...", sha256 = "..." }
(kernels/README.md describes the format.) `resolve_ops` turns a lock section into an `OpTable`:
a locked variant whose file is missing, changed (hash differs from the lock), fails to import or
is built for another arch is refused with one warning and its op runs the reference; a lock with
no section for this arch means the reference everywhere, never another arch's code.
"""

from __future__ import annotations

import json
import logging
import re
import tomllib
import types
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from .dispatch import BUCKET, KernelCall, exec_variant, load_locked, sha256_bytes
from .ops import CONTRACTS, OpTable, contract

log = logging.getLogger(__name__)

DEFAULT_ROOT = Path(__file__).resolve().parent.parent / "kernels"
LOCK_NAME = "registry.lock.toml"
STATUSES = ("candidate", "accepted", "rejected")
RECORD_SCHEMA = 1
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SHA = re.compile(r"^[0-9a-f]{64}$")


class RegistryError(ValueError):
    """A registry operation that cannot be done: says what was wrong and what to do."""


class KernelRefusedWarning(UserWarning):
    """A locked variant was refused at load time; its op runs the reference."""


@dataclass(frozen=True)
class LockEntry:
    variant: str
    sha256: str


@dataclass(frozen=True)
class Problem:
    """A recorded variant whose file no longer matches its record."""

    op: str
    variant: str
    kind: str  # "modified" | "missing"
    detail: str


def sha256(path: str | Path) -> str:
    return sha256_bytes(Path(path).read_bytes())


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


def _check_name(kind: str, name: str) -> str:
    if not _NAME.match(name):
        raise RegistryError(f"{kind} name {name!r} is not a plain identifier "
                            "(letters, digits, underscores)")
    return name


def _git_commit(start: Path) -> str | None:
    """HEAD's commit read from the .git directory above `start` (no subprocess)."""
    for d in [start, *start.parents]:
        git = d / ".git"
        if not (git / "HEAD").is_file():
            continue
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head
        ref = head[5:]
        if (git / ref).is_file():
            return (git / ref).read_text().strip()
        packed = git / "packed-refs"
        if packed.is_file():
            for line in packed.read_text().splitlines():
                if line.endswith(" " + ref):
                    return line.split()[0]
        return None
    return None


def new_record(op: str, variant: str, sha: str, *, agent: str, model: str | None = None,
               parent: str | None = None, prompt_sha256: str | None = None,
               status: str = "candidate", reason: str = "",
               archs: list[str] | None = None) -> dict[str, Any]:
    """A record skeleton with provenance; verification and benchmarks are filled in later."""
    if status not in STATUSES:
        raise RegistryError(f"status {status!r} is not one of {STATUSES}")
    return {
        "schema": RECORD_SCHEMA,
        "op": op,
        "variant": variant,
        "sha256": sha,
        "status": status,
        "status_reason": reason,
        "archs": archs,
        "provenance": {
            "agent": agent, "model": model, "parent": parent, "prompt_sha256": prompt_sha256,
            "time": datetime.now(UTC).isoformat(timespec="seconds"),
            "git_commit": _git_commit(DEFAULT_ROOT.parent),
        },
        "verification": {},
        "benchmarks": [],
    }


class Registry:
    """One registry directory: variants, records, tuned configs and the lock."""

    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root) if root is not None else DEFAULT_ROOT

    def __repr__(self) -> str:
        return f"Registry({str(self.root)!r})"

    @property
    def lock_path(self) -> Path:
        return self.root / LOCK_NAME

    sha256 = staticmethod(sha256)

    # ---- variants, records, configs -----------------------------------------------------------
    def ops(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(d.name for d in self.root.iterdir()
                      if d.is_dir() and _NAME.match(d.name) and (
                          any(d.glob("*.py")) or (d / "records").is_dir()))

    def variants(self, op: str) -> list[str]:
        d = self.root / _check_name("op", op)
        return sorted(p.stem for p in d.glob("*.py") if _NAME.match(p.stem)
                      and not p.stem.startswith("_"))

    def variant_path(self, op: str, name: str) -> Path:
        return self.root / _check_name("op", op) / f"{_check_name('variant', name)}.py"

    def _data_path(self, op: str, kind: str, name: str, ext: str) -> Path:
        return self.root / _check_name("op", op) / kind / f"{_check_name('variant', name)}.{ext}"

    def record_path(self, op: str, name: str) -> Path:
        return self._data_path(op, "records", name, "json")

    def config_path(self, op: str, name: str) -> Path:
        return self._data_path(op, "configs", name, "json")

    def read_record(self, op: str, name: str) -> dict[str, Any] | None:
        path = self.record_path(op, name)
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise RegistryError(f"record {path} is not valid JSON ({exc}); fix or delete "
                                "it") from exc

    def write_record(self, op: str, name: str, record: Mapping[str, Any]) -> Path:
        """Write a record, pinning the variant file's current sha256.

        Refuses when an existing record pins a different hash: a recorded variant is immutable,
        so changed code must be a new variant file (e.g. triton_v2.py).
        """
        src = self.variant_path(op, name)
        if not src.is_file():
            raise RegistryError(f"cannot record {op}/{name}: {src} does not exist")
        current = sha256(src)
        old = self.read_record(op, name)
        if old and old.get("sha256") and old["sha256"] != current:
            raise RegistryError(
                f"{src} changed since it was recorded (sha256 {old['sha256'][:12]} -> "
                f"{current[:12]}); variants are immutable: save the new code as a new variant")
        rec = dict(record)
        if rec.get("sha256") not in (None, current):
            raise RegistryError(f"record for {op}/{name} gives sha256 {rec['sha256'][:12]} but the "
                                f"file hashes to {current[:12]}")
        if rec.get("status", "candidate") not in STATUSES:
            raise RegistryError(f"status {rec.get('status')!r} is not one of {STATUSES}")
        rec.update(op=op, variant=name, sha256=current)
        path = self.record_path(op, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rec, indent=2, sort_keys=False, default=str) + "\n")
        return path

    def set_status(self, op: str, name: str, status: str, reason: str = "") -> dict[str, Any]:
        rec = self.read_record(op, name)
        if rec is None:
            raise RegistryError(f"{op}/{name} has no record at {self.record_path(op, name)}; "
                                "verify it first")
        if status not in STATUSES:
            raise RegistryError(f"status {status!r} is not one of {STATUSES}")
        rec.update(status=status, status_reason=reason)
        self.write_record(op, name, rec)
        return rec

    def read_configs(self, op: str, name: str) -> dict[str, dict[str, dict]]:
        path = self.config_path(op, name)
        if not path.is_file():
            return {}
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise RegistryError(f"tuned configs {path} are not valid JSON ({exc})") from exc
        if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
            raise RegistryError(f"{path} must map GPU name -> {{'T=<n>': config}}")
        return data

    def write_configs(self, op: str, name: str, configs: Mapping[str, Mapping[str, dict]]) -> Path:
        for gpu, buckets in configs.items():
            bad = [b for b in buckets if not BUCKET.match(b)]
            if bad:
                raise RegistryError(f"config buckets for {gpu} must look like 'T=8', got {bad}")
        path = self.config_path(op, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(configs, indent=2, sort_keys=True) + "\n")
        return path

    def check_immutable(self) -> list[Problem]:
        """Recorded variants whose file changed or disappeared since it was recorded."""
        problems = []
        for op in self.ops():
            for rec_path in sorted((self.root / op / "records").glob("*.json")):
                name = rec_path.stem
                rec = self.read_record(op, name) or {}
                src = self.variant_path(op, name)
                if not src.is_file():
                    problems.append(Problem(op, name, "missing", f"{src} is missing"))
                elif rec.get("sha256") and sha256(src) != rec["sha256"]:
                    problems.append(Problem(op, name, "modified", f"{src} hashes to "
                                            f"{sha256(src)[:12]}, recorded {rec['sha256'][:12]}"))
        return problems

    def load_variant(self, op: str, name: str) -> types.ModuleType:
        """Import a variant file by path (exactly the bytes hashed); import errors propagate."""
        path = self.variant_path(op, name)
        if not path.is_file():
            raise RegistryError(f"no variant {op}/{name}: {path} does not exist")
        data = path.read_bytes()
        return exec_variant(op, name, path, data, sha256_bytes(data))

    # ---- the lock -----------------------------------------------------------------------------
    def read_lock(self, path: str | Path | None = None) -> dict[str, dict[str, Any]]:
        """{arch: {op: raw entry}} of a lock file (this registry's by default); {} if absent."""
        path = Path(path) if path is not None else self.lock_path
        if not path.is_file():
            return {}
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise RegistryError(f"lock file {path} is not valid TOML: {exc}") from exc
        return {arch: dict(ops) for arch, ops in data.items() if isinstance(ops, dict)}

    def lock(self, arch: str, path: str | Path | None = None) -> dict[str, LockEntry]:
        """The valid entries of one arch section (malformed entries are dropped with a warning)."""
        out = {}
        for op, raw in self.read_lock(path).get(arch, {}).items():
            entry = _parse_entry(raw)
            if entry is None:
                warnings.warn(f"lock [{arch}] {op} = {raw!r} is not {{ variant = \"...\", sha256 = "
                              "\"<64 hex>\" }; ignoring it", KernelRefusedWarning, stacklevel=2)
                continue
            out[op] = entry
        return out

    def set_lock(self, arch: str, op: str, variant: str,
                 path: str | Path | None = None) -> LockEntry:
        """Select `variant` for (arch, op); only an accepted, unmodified variant can be locked."""
        contract(op)
        rec = self.read_record(op, variant)
        src = self.variant_path(op, variant)
        if rec is None:
            raise RegistryError(f"{op}/{variant} has no record; verify and benchmark it first")
        if rec.get("status") != "accepted":
            raise RegistryError(f"{op}/{variant} is {rec.get('status')!r}, not 'accepted': review "
                                "it (autoopt registry set-status ... accepted) before locking")
        if not src.is_file():
            raise RegistryError(f"{src} is missing")
        sha = sha256(src)
        if rec.get("sha256") != sha:
            raise RegistryError(f"{src} changed since it was recorded; it cannot be locked")
        archs = rec.get("archs")
        if archs and arch not in archs:
            raise RegistryError(f"{op}/{variant} is recorded for {archs}, not {arch}")
        data = self.read_lock(path)
        data.setdefault(arch, {})[op] = {"variant": variant, "sha256": sha}
        self.write_lock(data, path)
        return LockEntry(variant, sha)

    def unset_lock(self, arch: str, op: str, path: str | Path | None = None) -> bool:
        data = self.read_lock(path)
        removed = data.get(arch, {}).pop(op, None) is not None
        if removed:
            self.write_lock(data, path)
        return removed

    def write_lock(self, data: Mapping[str, Mapping[str, Any]], path: str | Path | None = None
                   ) -> Path:
        path = Path(path) if path is not None else self.lock_path
        lines = ["# Kernel variant per (GPU arch, op) used by `--kernels tuned`; written by",
                 "# `autoopt registry lock`. Only accepted variants are locked; sha256 pins the",
                 "# variant file, and a file that no longer matches is refused at load time.", ""]
        for arch in sorted(data):
            _check_name("arch", arch)
            lines.append(f"[{arch}]")
            for op in sorted(data[arch]):
                e = _parse_entry(data[arch][op])
                if e is None:
                    raise RegistryError(f"lock entry [{arch}] {op} is malformed: "
                                        f"{data[arch][op]!r}")
                lines.append(f'{_check_name("op", op)} = {{ variant = "{e.variant}", '
                             f'sha256 = "{e.sha256}" }}')
            lines.append("")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines))
        return path


def _parse_entry(raw: Any) -> LockEntry | None:
    if not isinstance(raw, dict):
        return None
    variant, sha = raw.get("variant"), raw.get("sha256")
    if not isinstance(variant, str) or not _NAME.match(variant):
        return None
    if not isinstance(sha, str) or not _SHA.match(sha):
        return None
    return LockEntry(variant, sha)


# ---- runtime dispatch ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Resolution:
    """How one op was resolved: `source` is what OpTable.sources shows; `refused` says why not."""

    op: str
    source: str
    variant: str | None = None
    refused: str | None = None


def resolve_ops(kernels: str | Path = "tuned", registry: str | Path | None = None,
                arch: str | None = None, device: str | torch.device | None = None,
                dtype: torch.dtype | None = None) -> OpTable:
    """The OpTable for `--kernels tuned|reference|<lock file>` on this machine.

    `tuned` reads the registry's own lock, a path reads that lock file (variants still come from
    `registry`, default the repo's kernels/). The section is this machine's arch (`sm_90`,
    `cpu`; from `device`, or `arch` to override). Refused variants warn once each
    (KernelRefusedWarning) and fall back to the reference; `table.resolution` says per op.
    Variants implement the BF16 contracts: a model of another `dtype` (FP32 parity runs) runs
    every op's reference, said in `table.resolution`.
    """
    reg = Registry(registry)
    arch = arch or current_arch(device)
    table_impls: dict[str, Callable] = {}
    sources: dict[str, str] = {}
    resolution = {op: Resolution(op, "reference") for op in CONTRACTS}
    entries: dict[str, LockEntry] = {}
    if str(kernels) != "reference":
        lock_path = reg.lock_path if str(kernels) == "tuned" else Path(kernels)
        if str(kernels) != "tuned" and not lock_path.is_file():
            raise RegistryError(f"--kernels {kernels}: no such lock file (use tuned, reference or "
                                "the path of a registry.lock.toml)")
        try:
            if arch not in reg.read_lock(lock_path):
                log.info("lock %s has no [%s] section: every op runs the reference", lock_path,
                         arch)
            entries = reg.lock(arch, lock_path)
        except RegistryError as exc:
            warnings.warn(f"{exc}; every op runs the reference", KernelRefusedWarning,
                          stacklevel=2)
    gpu = gpu_name(device) if arch != "cpu" else "cpu"
    if dtype is not None and dtype != torch.bfloat16 and entries:
        why = f"registry variants implement the BF16 contracts; a {dtype} model runs the reference"
        log.info("--kernels %s: %s", kernels, why)
        resolution.update({op: Resolution(op, "reference", e.variant, why)
                           for op, e in entries.items() if op in CONTRACTS})
        entries = {}
    for op, entry in sorted(entries.items()):
        if op not in CONTRACTS:
            warnings.warn(f"lock [{arch}] names unknown op {op!r}; ignoring it",
                          KernelRefusedWarning, stacklevel=2)
            continue
        call, why = load_locked(reg, op, entry, arch, gpu)
        if call is None:
            warnings.warn(f"kernel {op}/{entry.variant} refused for {arch}: {why}; {op} runs the "
                          "reference", KernelRefusedWarning, stacklevel=2)
            resolution[op] = Resolution(op, "reference", entry.variant, why)
            continue
        table_impls[op], sources[op] = call, call.source
        resolution[op] = Resolution(op, call.source, entry.variant)
    table = OpTable(table_impls, sources)
    table.resolution = resolution
    return table


__all__ = ["DEFAULT_ROOT", "KernelCall", "KernelRefusedWarning", "LOCK_NAME", "LockEntry",
           "Problem", "Registry", "RegistryError", "Resolution", "STATUSES", "current_arch",
           "gpu_name", "new_record", "resolve_ops", "sha256"]
