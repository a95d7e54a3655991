"""One registry directory on disk: safe paths, and reading and writing its files.

    <op>/<variant>.py              a variant (immutable once recorded)
    <op>/records/<variant>.json    its record (schema.Record)
    <op>/configs/<variant>.json    its accepted tuned configs (configs.ConfigTable)
    <op>/NOTES.md                  hypothesis -> prediction -> result, one entry per variant
    registry.lock.toml             the lock (lock.Lock)

Every file read for the runtime must be a regular file inside the registry root (no symlinks on
the way, nothing resolving outside). The `_write_*` methods are raw: only `writers.py`, the one
writer per kind of change, calls them. A registry opened with a `seed` (the per-user registry)
reads the seed until its first write, which copies the seed into place first; a read-only one
(the copy shipped in the wheel) refuses every write with what to do instead.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import stat
import types
from dataclasses import dataclass
from pathlib import Path

from .configs import ConfigTable
from .lock import LOCK_NAME, Lock
from .names import NAME, RegistryError, check_name, dump_json, sha256_bytes
from .paths import is_shipped_copy, shipped_root
from .schema import SCHEMA, Record, Variant

log = logging.getLogger("model.registry")


@dataclass(frozen=True)
class Problem:
    """A recorded variant whose file no longer matches its record, or is not a regular file."""

    op: str
    variant: str
    kind: str  # "modified" | "missing" | "unsafe"
    detail: str


class Registry:
    """One registry directory: variants, records, tuned configs and the lock."""

    def __init__(self, root: str | Path | None = None, *, seed: str | Path | None = None,
                 read_only: bool | None = None) -> None:
        self._root = Path(root) if root is not None else shipped_root()
        self._seed = Path(seed) if seed is not None else None
        self.read_only = is_shipped_copy(self._root) if read_only is None else read_only

    def __repr__(self) -> str:
        return f"Registry({str(self.root)!r})"

    @property
    def root(self) -> Path:
        """Where reads happen: the directory, or its seed until the first write."""
        if self._seed is not None and not self._root.exists():
            return self._seed
        return self._root

    @staticmethod
    def sha256(path: str | Path) -> str:
        """sha256 of any file's bytes (a candidate outside the registry, say)."""
        return sha256_bytes(Path(path).read_bytes())

    @property
    def lock_path(self) -> Path:
        return self.root / LOCK_NAME

    # ---- paths ------------------------------------------------------------------------------
    def variant_path(self, op: str, name: str) -> Path:
        return self.root / check_name("op", op) / f"{check_name('variant', name)}.py"

    def record_path(self, op: str, name: str) -> Path:
        return self.root / check_name("op", op) / "records" / f"{check_name('variant', name)}.json"

    def config_path(self, op: str, name: str) -> Path:
        return self.root / check_name("op", op) / "configs" / f"{check_name('variant', name)}.json"

    def notes_path(self, op: str) -> Path:
        return self.root / check_name("op", op) / "NOTES.md"

    def safe_bytes(self, path: Path) -> bytes:
        """The bytes of `path`, a regular file inside the root reached through no symlink."""
        root = self.root
        try:
            rel = path.relative_to(root)
        except ValueError:
            raise RegistryError(f"{path} is not inside the registry {root}") from None
        cur = root
        for part in rel.parts:
            cur = cur / part
            if cur.is_symlink():
                raise RegistryError(f"{cur} is a symlink; registry files must be regular files "
                                    f"inside {root}")
        if not path.resolve().is_relative_to(root.resolve()):
            raise RegistryError(f"{path} resolves outside the registry {root}")
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise RegistryError(f"{path} is not a regular file")
        return path.read_bytes()

    # ---- listing ----------------------------------------------------------------------------
    def ops(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(d.name for d in self.root.iterdir()
                      if d.is_dir() and NAME.match(d.name) and (
                          any(d.glob("*.py")) or (d / "records").is_dir()))

    def variants(self, op: str) -> list[str]:
        """Variant files of `op` (a symlink is listed, and refused wherever it is read)."""
        d = self.root / check_name("op", op)
        return sorted(p.stem for p in d.glob("*.py") if NAME.match(p.stem)
                      and not p.stem.startswith("_"))

    def names(self, op: str) -> list[str]:
        """Every variant of `op` with a file or a record."""
        recs = {p.stem for p in (self.root / op / "records").glob("*.json") if NAME.match(p.stem)}
        return sorted(set(self.variants(op)) | recs)

    # ---- reading ----------------------------------------------------------------------------
    def read_variant(self, op: str, name: str) -> tuple[Variant, bytes]:
        """The file's bytes and what they are; RegistryError if missing or not a safe file."""
        path = self.variant_path(op, name)
        if not path.exists() and not path.is_symlink():
            raise RegistryError(f"no variant {op}/{name}: {path} does not exist")
        data = self.safe_bytes(path)
        return Variant.from_source(op, name, data), data

    def read_record(self, op: str, name: str) -> Record | None:
        path = self.record_path(op, name)
        if not path.exists() and not path.is_symlink():
            return None
        try:
            data = json.loads(self.safe_bytes(path))
        except json.JSONDecodeError as exc:
            raise RegistryError(f"record {path} is not valid JSON ({exc}); fix or delete "
                                "it") from None
        rec = Record.from_json(data, str(path))
        if (rec.op, rec.name) != (op, name):
            raise RegistryError(f"{path} holds the record of {rec.op}/{rec.name}")
        return rec

    def read_configs(self, op: str, name: str) -> ConfigTable:
        """The accepted tuned configs of a variant (empty when it has none)."""
        path = self.config_path(op, name)
        if not path.exists() and not path.is_symlink():
            return ConfigTable()
        try:
            data = json.loads(self.safe_bytes(path))
        except json.JSONDecodeError as exc:
            raise RegistryError(f"tuned configs {path} are not valid JSON ({exc})") from None
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise RegistryError(f"{path} is not a schema {SCHEMA} configs file: run `autoopt "
                                "registry migrate` on its registry")
        if (data.get("op"), data.get("variant")) != (op, name):
            raise RegistryError(f"{path} holds the configs of {data.get('op')}/"
                                f"{data.get('variant')}")
        return ConfigTable.from_json(data.get("configs", {}), str(path))

    def read_lock(self, path: str | Path | None = None, missing_ok: bool = True) -> Lock:
        """This registry's lock (or the lock file at `path`); empty when absent and missing_ok."""
        path = Path(path) if path is not None else self.lock_path
        if not path.is_file():
            if missing_ok:
                return Lock(path=path)
            raise RegistryError(f"no lock file: looked for {path}")
        return Lock.read(path)

    def notes_entries(self, op: str, name: str) -> list[str]:
        """The `## <name> ...` sections of <op>/NOTES.md (markdown, heading included), in file
        order: the variant's entry and any later ones (its tuned configs)."""
        path = self.notes_path(op)
        check_name("variant", name)
        if not path.exists() and not path.is_symlink():
            return []
        text = self.safe_bytes(path).decode(errors="replace")
        sections = re.split(r"(?m)^(?=## )", text)
        head = re.compile(rf"## {re.escape(name)}(?![A-Za-z0-9_])")
        return [s.rstrip() + "\n" for s in sections if head.match(s)]

    def load_variant(self, op: str, name: str) -> types.ModuleType:
        """Execute a variant file (exactly the bytes hashed); its import errors propagate.
        For tools and tests: the runtime loads through `runtime.resolve_ops`, with evidence."""
        from .runtime import exec_variant

        variant, data = self.read_variant(op, name)
        return exec_variant(op, name, self.variant_path(op, name), data, variant.sha256)

    def check_immutable(self) -> list[Problem]:
        """Recorded variants whose file changed, disappeared or is not a safe regular file."""
        problems = []
        for op in self.ops():
            for rec_path in sorted((self.root / op / "records").glob("*.json")):
                name = rec_path.stem
                try:
                    rec = self.read_record(op, name)
                    _, data = self.read_variant(op, name)
                except RegistryError as exc:
                    missing = not self.variant_path(op, name).exists()
                    problems.append(Problem(op, name, "missing" if missing else "unsafe",
                                            str(exc)))
                    continue
                sha = sha256_bytes(data)
                if rec is not None and sha != rec.variant.sha256:
                    problems.append(Problem(op, name, "modified", f"{op}/{name}.py hashes to "
                                            f"{sha[:12]}, recorded {rec.variant.sha256[:12]}"))
        return problems

    # ---- raw writes (writers.py only) -------------------------------------------------------
    def prepare_write(self) -> Path:
        """The directory writes go to, seeded from the shipped registry on first write."""
        if self.read_only:
            raise RegistryError(
                f"the registry at {self._root} is the copy shipped with autoopt and is read-only: "
                "pass --registry DIR (or set AUTOOPT_REGISTRY) for a registry you can write")
        if self._seed is not None and not self._root.exists():
            shutil.copytree(self._seed, self._root,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            log.info("created the registry %s from %s", self._root, self._seed)
        self._root.mkdir(parents=True, exist_ok=True)
        return self._root

    def _write(self, path: Path, text: str | bytes) -> Path:
        # Callers compute `path` after prepare_write(), so a seeded registry writes in place.
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink():
            raise RegistryError(f"{path} is a symlink; refusing to write through it")
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(text.encode() if isinstance(text, str) else text)
        tmp.replace(path)  # readers never see half a file
        return path

    def _write_variant(self, op: str, name: str, data: bytes) -> Path:
        self.prepare_write()
        path = self.variant_path(op, name)
        if path.exists() or path.is_symlink():
            raise RegistryError(f"{path} exists; a variant is never overwritten (new code is a "
                                "new variant)")
        return self._write(path, data)

    def _write_record(self, record: Record) -> Path:
        """Write a record whose variant file holds exactly the recorded bytes; an existing
        record of other bytes is refused (a recorded variant is immutable)."""
        op, name = record.op, record.name
        self.prepare_write()
        variant, _ = self.read_variant(op, name)
        old = self.read_record(op, name)
        if old is not None and old.variant.sha256 != variant.sha256:
            raise RegistryError(
                f"{op}/{name}.py changed since it was recorded (sha256 "
                f"{old.variant.sha256[:12]} -> {variant.sha256[:12]}); variants are immutable: "
                "save the new code as a new variant")
        if variant.sha256 != record.variant.sha256:
            raise RegistryError(f"{op}/{name}.py hashes to {variant.sha256[:12]} but the record "
                                f"says {record.variant.sha256[:12]}")
        return self._write(self.record_path(op, name), dump_json(record.to_json()))

    def _write_configs(self, op: str, name: str, table: ConfigTable) -> Path:
        self.prepare_write()
        path = self.config_path(op, name)
        if not table:
            if path.exists():
                path.unlink()
            return path
        return self._write(path, dump_json({"schema": SCHEMA, "op": op, "variant": name,
                                            "configs": table.to_json()}))

    def _write_lock(self, lock: Lock, path: str | Path | None = None) -> Path:
        """The registry's lock, or a lock file elsewhere (a run's trial lock) at `path`."""
        if path is None:
            self.prepare_write()
        return self._write(Path(path) if path is not None else self.lock_path, lock.to_toml())

    def _append_notes(self, op: str, entry: str) -> Path:
        self.prepare_write()
        notes = self.notes_path(op)
        if not notes.exists():
            self._write(notes, f"# {op}: notes per variant (hypothesis -> prediction -> "
                               "result)\n")
        with notes.open("a") as f:
            f.write(entry)
        return notes
