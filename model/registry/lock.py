"""The lock: which accepted variant, with which tuned configs, runs per (GPU arch, op).

    [sm_90]
    rmsnorm = { variant = "triton_v1", sha256 = "<file>", configs_sha256 = "<configs table>" }

`sha256` pins the variant file's bytes and `configs_sha256` its tuned configs (the hash of the
entries of configs/<variant>.json, `ConfigTable.sha256`): a file or a config changed after
locking no longer matches and is refused at load. Malformed entries are kept out of the parsed
lock and listed in `problems`, so the runtime can warn and the CLI can fail on them.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .names import RegistryError, check_arch, check_name, check_sha, freeze

LOCK_NAME = "registry.lock.toml"
_HEADER = ("# Kernel variant per (GPU arch, op) used by `--kernels tuned`; written by",
           "# `autoopt registry lock` and `autoopt review accept`. Only accepted variants are",
           "# locked; sha256 pins the variant file and configs_sha256 its tuned configs: what no",
           "# longer matches is refused at load time and its op runs the reference.")


@dataclass(frozen=True)
class LockEntry:
    variant: str
    sha256: str
    configs_sha256: str

    def __post_init__(self) -> None:
        check_name("variant", self.variant)
        check_sha("lock sha256", self.sha256)
        check_sha("lock configs_sha256", self.configs_sha256)

    @classmethod
    def from_toml(cls, raw: Any) -> LockEntry:
        if not isinstance(raw, Mapping):
            raise RegistryError(f"{raw!r} is not an inline table")
        extra = set(raw) - {"variant", "sha256", "configs_sha256"}
        if extra:
            raise RegistryError(f"unknown keys {sorted(extra)}")
        if "configs_sha256" not in raw:
            raise RegistryError("no configs_sha256 (a lock from before configs were pinned: run "
                                "`autoopt registry migrate`, or lock the variant again)")
        return cls(raw.get("variant"), raw.get("sha256"), raw.get("configs_sha256"))

    def to_toml(self) -> str:
        return (f'{{ variant = "{self.variant}", sha256 = "{self.sha256}", '
                f'configs_sha256 = "{self.configs_sha256}" }}')


@dataclass(frozen=True)
class Lock:
    sections: Mapping[str, Mapping[str, LockEntry]] = field(default_factory=dict)
    problems: tuple[str, ...] = ()
    path: Path | None = None

    def __post_init__(self) -> None:
        for arch, ops in self.sections.items():
            check_arch(arch)
            for op in ops:
                check_name("op", op)
        object.__setattr__(self, "sections", freeze(
            {a: dict(sorted(ops.items())) for a, ops in sorted(self.sections.items())}))

    def section(self, arch: str) -> Mapping[str, LockEntry]:
        return self.sections.get(arch, {})

    def entries(self) -> list[tuple[str, str, LockEntry]]:
        return [(a, op, e) for a, ops in self.sections.items() for op, e in ops.items()]

    def with_entry(self, arch: str, op: str, entry: LockEntry) -> Lock:
        sections = {a: dict(ops) for a, ops in self.sections.items()}
        sections.setdefault(arch, {})[op] = entry
        return Lock(sections, self.problems, self.path)

    def without(self, arch: str, op: str) -> Lock:
        sections = {a: {o: e for o, e in ops.items() if (a, o) != (arch, op)}
                    for a, ops in self.sections.items()}
        return Lock({a: ops for a, ops in sections.items() if ops}, self.problems, self.path)

    def to_toml(self) -> str:
        lines = [*_HEADER, ""]
        for arch, ops in self.sections.items():
            lines.append(f"[{arch}]")
            lines += [f"{op} = {e.to_toml()}" for op, e in ops.items()]
            lines.append("")
        return "\n".join(lines)

    @classmethod
    def parse(cls, text: str, where: str = LOCK_NAME) -> Lock:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise RegistryError(f"lock file {where} is not valid TOML: {exc}") from None
        sections: dict[str, dict[str, LockEntry]] = {}
        problems = []
        for arch, ops in data.items():
            if not isinstance(ops, Mapping):
                problems.append(f"{where}: {arch} = {ops!r} is not an [arch] section")
                continue
            try:
                check_arch(arch)
            except RegistryError as exc:
                problems.append(f"{where}: [{arch}]: {exc}")
                continue
            for op, raw in ops.items():
                try:
                    check_name("op", op)
                    sections.setdefault(arch, {})[op] = LockEntry.from_toml(raw)
                except RegistryError as exc:
                    problems.append(f"{where}: [{arch}] {op}: {exc}")
        return cls(sections, tuple(problems), Path(where))

    @classmethod
    def read(cls, path: Path) -> Lock:
        if not path.is_file():
            raise RegistryError(f"no lock file at {path}")
        return cls.parse(path.read_text(), str(path))
