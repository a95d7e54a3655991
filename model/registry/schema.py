"""The typed, frozen records of a registry (schema 2) and their JSON form.

    records/<variant>.json = {
      "schema": 2,
      "variant": {"op", "name", "sha256", "language", "library", "archs", "runs_on_cpu"},
      "status": "candidate | accepted | rejected", "status_reason": "...",
      "provenance": {"agent", "model", "parent", "prompt_sha256", "time", "git_commit", "run"},
      "verification": {"<arch>": [{"verdict", "sha256", "device", "config", "reasons",
                                    "report": {<the judge's report>}}]},
      "benchmarks": [{<a timing row: target, gpu, shape, median_us, x_reference, ...>}],
      "proposed_configs": {<configs awaiting review, as in configs/<variant>.json>},
      "tunings": [{<evidence of each tuning: run, gpu, configs, verification, benchmarks>}],
      "optimize": {<what the optimize loop saw: run, speedup, baseline, profile row>} | null,
      "review": [{"time", "action", ...}]
    }
Verification is per arch because an interpreter run on the CPU says nothing about a GPU's
rounding, and each entry names the sha256 of the file it verified: the runtime loads a file only
where an accepted record verified exactly those bytes for the machine's arch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from .configs import ConfigTable
from .languages import DEFAULT_LANGUAGE, read_declarations
from .names import RegistryError, check_arch, check_name, check_sha, freeze, sha256_bytes, thaw

SCHEMA = 2
STATUSES = ("candidate", "accepted", "rejected")
VERDICTS = ("pass", "reject")


@dataclass(frozen=True)
class Variant:
    """A variant file as recorded: which op, its name, the bytes' hash and what it declares."""

    op: str
    name: str
    sha256: str
    language: str = DEFAULT_LANGUAGE
    archs: tuple[str, ...] | None = None
    runs_on_cpu: bool = True
    library: str | None = None

    def __post_init__(self) -> None:
        check_name("op", self.op)
        check_name("variant", self.name)
        check_sha(f"sha256 of {self.op}/{self.name}", self.sha256)
        for arch in self.archs or ():
            check_arch(arch)

    @classmethod
    def from_source(cls, op: str, name: str, data: bytes) -> Variant:
        decl = read_declarations(data, f"{op}/{name}.py")
        return cls(op, name, sha256_bytes(data), decl.language, decl.archs, decl.runs_on_cpu,
                   decl.library)

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "name": self.name, "sha256": self.sha256,
                "language": self.language, "library": self.library,
                "archs": list(self.archs) if self.archs is not None else None,
                "runs_on_cpu": self.runs_on_cpu}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Variant:
        archs = d.get("archs")
        return cls(d["op"], d["name"], d["sha256"], d.get("language", DEFAULT_LANGUAGE),
                   tuple(archs) if archs is not None else None, bool(d.get("runs_on_cpu", True)),
                   d.get("library"))


@dataclass(frozen=True)
class Provenance:
    agent: str
    model: str | None = None
    parent: str | None = None
    prompt_sha256: str | None = None
    time: str | None = None
    git_commit: str | None = None
    run: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.agent, str) or not self.agent:
            raise RegistryError("provenance needs the agent that wrote the variant "
                                "('hand-written', 'template', 'claude', ...)")


@dataclass(frozen=True)
class Verification:
    """One verification of a file on one arch; `report` is the judge's evidence as it gave it."""

    arch: str
    verdict: str
    sha256: str
    device: str | None = None
    config: Mapping[str, Any] | None = None
    reasons: tuple[str, ...] = ()
    report: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_arch(self.arch)
        if self.verdict not in VERDICTS:
            raise RegistryError(f"verdict {self.verdict!r} is not one of {VERDICTS}")
        check_sha("verified sha256", self.sha256)
        object.__setattr__(self, "config", freeze(self.config))
        object.__setattr__(self, "reasons", tuple(str(r) for r in self.reasons))
        object.__setattr__(self, "report", freeze(self.report))

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    @classmethod
    def from_report(cls, arch: str, report: Mapping[str, Any], sha256: str | None = None,
                    source: str | None = None) -> Verification:
        """From a judge's report (autoopt.eval's VerifyReport as a dict, or a slim copy of it).
        The report's file path is replaced by `source` (registry-relative: no machine paths)."""
        checks = report.get("checks") or {}
        sha = report.get("sha256") or (checks.get("import") or {}).get("sha256") or sha256
        if sha is None:
            raise RegistryError("a verification report must say which file it verified (sha256)")
        lifted = {"verdict", "sha256", "device", "config", "reasons", "source"}
        rest = {k: v for k, v in report.items() if k not in lifted}
        if source is not None:
            rest["source"] = source
        return cls(arch, str(report.get("verdict")), sha, report.get("device"),
                   report.get("config"), tuple(report.get("reasons") or ()), rest)

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "sha256": self.sha256, "device": self.device,
                "config": thaw(self.config), "reasons": list(self.reasons),
                "report": thaw(self.report)}


@dataclass(frozen=True)
class Benchmark:
    """One timing row (autoopt.eval's BenchRow plus the target it was timed for)."""

    row: Mapping[str, Any]

    def __post_init__(self) -> None:
        if not isinstance(self.row, Mapping) or not isinstance(self.row.get("shape"), Mapping):
            raise RegistryError(f"a benchmark row needs a shape, got {self.row!r}")
        object.__setattr__(self, "row", freeze(self.row))

    def get(self, key: str, default: Any = None) -> Any:
        return self.row.get(key, default)

    @property
    def gpu(self) -> str | None:
        return self.row.get("gpu") or self.row.get("device")

    @property
    def shape(self) -> Mapping[str, int]:
        return self.row["shape"]

    @property
    def meaningful(self) -> bool:
        return bool(self.row.get("meaningful", True))

    @property
    def x_reference(self) -> float | None:
        return self.row.get("x_reference")


@dataclass(frozen=True)
class Record:
    variant: Variant
    provenance: Provenance
    status: str = "candidate"
    status_reason: str = ""
    verification: Mapping[str, tuple[Verification, ...]] = field(default_factory=dict)
    benchmarks: tuple[Benchmark, ...] = ()
    proposed_configs: ConfigTable = ConfigTable()
    tunings: tuple[Mapping[str, Any], ...] = ()
    optimize: Mapping[str, Any] | None = None
    review: tuple[Mapping[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise RegistryError(f"status {self.status!r} is not one of {STATUSES}")
        for arch, vs in self.verification.items():
            if any(v.arch != arch for v in vs):
                raise RegistryError(f"verification under {arch!r} names another arch")
        object.__setattr__(self, "verification", freeze(
            {a: tuple(vs) for a, vs in sorted(self.verification.items())}))
        for name in ("tunings", "review"):
            object.__setattr__(self, name, freeze(list(getattr(self, name))))
        object.__setattr__(self, "optimize", freeze(self.optimize))

    @property
    def op(self) -> str:
        return self.variant.op

    @property
    def name(self) -> str:
        return self.variant.name

    def verdict(self, arch: str) -> str:
        """`pass` when every verification on `arch` of this record's file passed (at least one),
        `reject` when one did not, `stale` when only other files were verified, `unverified`."""
        on_arch = self.verification.get(arch, ())
        if not on_arch:
            return "unverified"
        mine = [v for v in on_arch if v.sha256 == self.variant.sha256]
        if not mine:
            return "stale"
        return "pass" if all(v.passed for v in mine) else "reject"

    def verdicts(self) -> dict[str, str]:
        return {arch: self.verdict(arch) for arch in self.verification}

    def verified(self, arch: str, sha256: str) -> bool:
        """This record's file is `sha256` and it passed verification on `arch`."""
        return self.variant.sha256 == sha256 and self.verdict(arch) == "pass"

    def replace(self, **changes: Any) -> Record:
        return replace(self, **changes)

    def with_verification(self, v: Verification, keep_others: bool = True) -> Record:
        """This record with `v` added on its arch (`keep_others=False`: in place of the arch's
        earlier entries, as a fresh full verification replaces an old one)."""
        ver = dict(self.verification)
        ver[v.arch] = (tuple(ver.get(v.arch, ())) if keep_others else ()) + (v,)
        return self.replace(verification=ver)

    def with_review(self, entry: Mapping[str, Any]) -> Record:
        return self.replace(review=(*self.review, entry))

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "variant": self.variant.to_json(), "status": self.status,
                "status_reason": self.status_reason,
                "provenance": {f.name: getattr(self.provenance, f.name)
                               for f in fields(Provenance)},
                "verification": {a: [v.to_json() for v in vs]
                                 for a, vs in self.verification.items()},
                "benchmarks": [thaw(b.row) for b in self.benchmarks],
                "proposed_configs": self.proposed_configs.to_json(),
                "tunings": thaw(self.tunings), "optimize": thaw(self.optimize),
                "review": thaw(self.review)}

    @classmethod
    def from_json(cls, d: Any, where: str = "record") -> Record:
        if not isinstance(d, Mapping):
            raise RegistryError(f"{where} must be a JSON object")
        if d.get("schema") != SCHEMA:
            raise RegistryError(f"{where} is schema {d.get('schema')!r}, this autoopt reads "
                                f"schema {SCHEMA}: run `autoopt registry migrate` on its registry")
        unknown = set(d) - {"schema", *(f.name for f in fields(cls))}
        if unknown:
            raise RegistryError(f"{where} has unknown keys {sorted(unknown)}")
        try:
            return cls(
                variant=Variant.from_json(d["variant"]),
                provenance=Provenance(**d["provenance"]), status=d.get("status", "candidate"),
                status_reason=d.get("status_reason", ""),
                verification={a: tuple(Verification(a, **v) for v in vs)
                              for a, vs in (d.get("verification") or {}).items()},
                benchmarks=tuple(Benchmark(b) for b in d.get("benchmarks") or ()),
                proposed_configs=ConfigTable.from_json(d.get("proposed_configs") or {},
                                                       f"{where} proposed_configs"),
                tunings=tuple(d.get("tunings") or ()), optimize=d.get("optimize"),
                review=tuple(d.get("review") or ()))
        except (KeyError, TypeError) as exc:
            raise RegistryError(f"{where} does not follow schema {SCHEMA}: {exc!r}") from None
