"""Every change to a registry, one writer per kind of change.

    register   a new candidate: a new immutable variant file and its record
    tune       proposed configs (+ their evidence) on a variant's record, for review
    record     verification and benchmarks of a variant already in the registry (hand-written
               variants: `autoopt registry record`, benchmarks/gpu_kernels.py)
    accept     status accepted; its proposed configs move into configs/; locked for an arch
    reject     status rejected, with the reviewer's reason; removed from the lock
    set_status accept / reject / back to candidate without locking (`registry set-status`)
    lock       select an accepted variant verified on the arch, pinning file and configs
    unlock     remove an (arch, op) selection
    note       append to <op>/NOTES.md

Configs reach configs/ only through `accept`, so what the runtime runs is always what a review
(or --auto-accept) saw. Every writer takes a Registry and returns what it wrote; refusals raise
RegistryError saying what to do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .configs import ConfigTable
from .lock import LockEntry
from .names import RegistryError, check_arch, check_name
from .paths import checkout_root
from .schema import STATUSES, Benchmark, Provenance, Record, Variant, Verification
from .store import Registry


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def git_commit() -> str | None:
    """HEAD of the source checkout this package runs from, read from .git (no subprocess)."""
    root = checkout_root()
    git = root / ".git" if root is not None else None
    if git is not None and git.is_file():  # a worktree: .git names the real git dir
        text = git.read_text().strip()
        git = Path(text[8:]) if text.startswith("gitdir: ") else None
    if git is None or not (git / "HEAD").is_file():
        return None
    head = (git / "HEAD").read_text().strip()
    if not head.startswith("ref: "):
        return head
    ref = head[5:]
    for base in (git, git.parent.parent if git.parent.name == "worktrees" else git):
        if (base / ref).is_file():
            return (base / ref).read_text().strip()
        packed = base / "packed-refs"
        if packed.is_file():
            for line in packed.read_text().splitlines():
                if line.endswith(" " + ref):
                    return line.split()[0]
    return None


def provenance(agent: str, **fields: Any) -> Provenance:
    """Provenance stamped with the time and the checkout's commit."""
    return Provenance(agent=agent, time=now_iso(), git_commit=git_commit(), **fields)


def _require(reg: Registry, op: str, name: str) -> Record:
    rec = reg.read_record(op, name)
    if rec is None:
        known = ", ".join(reg.names(op)) if (reg.root / op).is_dir() else "none"
        raise RegistryError(f"no record for {op}/{name} in {reg.root}; variants of {op}: {known} "
                            "(autoopt registry record OP VARIANT verifies and records one)")
    return rec


# ---- new code and its evidence ----------------------------------------------------------------
def register(reg: Registry, op: str, name: str, source: bytes, prov: Provenance,
             verification: Iterable[Verification] = (), benchmarks: Iterable[Mapping] = (),
             proposed: ConfigTable = ConfigTable(), optimize: Mapping | None = None,
             reason: str = "verified; awaiting review") -> Record:
    """A new candidate: writes `<op>/<name>.py` (never over an existing file) and its record."""
    from model.ops import contract

    contract(op)
    variant = Variant.from_source(op, check_name("variant", name), source)
    rec = Record(variant, prov, "candidate", reason, _by_arch(verification),
                 tuple(Benchmark(b) for b in benchmarks), proposed, optimize=optimize)
    _check_verified_bytes(rec)
    reg._write_variant(op, name, source)
    reg._write_record(rec)
    return rec


def _by_arch(vs: Iterable[Verification]) -> dict[str, tuple[Verification, ...]]:
    out: dict[str, tuple[Verification, ...]] = {}
    for v in vs:
        out[v.arch] = (*out.get(v.arch, ()), v)
    return out


def _check_verified_bytes(rec: Record) -> None:
    other = [v for vs in rec.verification.values() for v in vs
             if v.sha256 != rec.variant.sha256]
    if other:
        raise RegistryError(f"a verification of {rec.op}/{rec.name} names sha256 "
                            f"{other[0].sha256[:12]}, not the file's {rec.variant.sha256[:12]}")


def tune(reg: Registry, op: str, name: str, configs: ConfigTable,
         evidence: Mapping[str, Any]) -> Record:
    """Propose tuned configs for a recorded variant; `accept` moves them into configs/."""
    if not configs:
        raise RegistryError(f"no configs to propose for {op}/{name}")
    rec = _require(reg, op, name)
    rec = rec.replace(proposed_configs=rec.proposed_configs.merged(configs.entries),
                      tunings=(*rec.tunings, {"time": now_iso(), "configs": configs.to_json(),
                                              **evidence}))
    reg._write_record(rec)
    return rec


def record(reg: Registry, op: str, name: str, verification: Sequence[Verification],
           benchmarks: Sequence[Mapping] = (), agent: str = "hand-written",
           drop_gpus: Sequence[str] = ()) -> Record:
    """Verification (it replaces the earlier entries of the same archs) and benchmark rows (they
    replace the rows of the same GPUs, and of `drop_gpus`: rows a failed timing run had
    written) of a variant file already in the registry; a variant without a record gets a
    candidate record first."""
    variant, _ = reg.read_variant(op, name)
    rec = reg.read_record(op, name) or Record(variant, provenance(agent), "candidate",
                                              "recorded; awaiting review")
    for arch in {v.arch for v in verification}:
        rec = rec.replace(verification={**rec.verification, arch: ()})
    for v in verification:
        rec = rec.with_verification(v)
    rows = [Benchmark(b) for b in benchmarks]
    gpus = {b.gpu for b in rows} | set(drop_gpus)
    kept = tuple(b for b in rec.benchmarks if b.gpu not in gpus)
    rec = rec.replace(benchmarks=kept + tuple(rows))
    _check_verified_bytes(rec)
    reg._write_record(rec)
    return rec


def note(reg: Registry, op: str, entry: str) -> Path:
    return reg._append_notes(op, entry)


# ---- review and the lock ----------------------------------------------------------------------
def lock_entry(reg: Registry, op: str, name: str, arch: str,
               allow_candidates: bool = False) -> LockEntry:
    """The pin for (arch, op) = name: checked like the runtime checks it, not written."""
    check_arch(arch)
    rec = _require(reg, op, name)
    variant, _ = reg.read_variant(op, name)
    allowed = ("accepted", "candidate") if allow_candidates else ("accepted",)
    if rec.status not in allowed:
        raise RegistryError(f"{op}/{name} is {rec.status!r}, not 'accepted': review it "
                            "(autoopt registry accept OP VARIANT) before locking")
    if rec.variant.sha256 != variant.sha256:
        raise RegistryError(f"{op}/{name}.py changed since it was recorded; it cannot be locked")
    if not rec.verified(arch, variant.sha256):
        raise RegistryError(f"{op}/{name} has no passing verification on {arch} (verdicts: "
                            f"{rec.verdicts() or 'none'}); verify it there first (autoopt "
                            "registry record OP VARIANT on that machine)")
    if variant.archs and arch not in variant.archs:
        raise RegistryError(f"{op}/{name} declares ARCHS = {variant.archs}, not {arch}")
    configs = reg.read_configs(op, name) if rec.status == "accepted" else rec.proposed_configs
    return LockEntry(name, variant.sha256, configs.sha256)


def lock(reg: Registry, arch: str, op: str, name: str, path: str | Path | None = None
         ) -> LockEntry:
    """Select an accepted, verified variant for (arch, op) in the lock (or the file `path`)."""
    from model.ops import contract

    contract(op)
    entry = lock_entry(reg, op, name, arch)
    reg._write_lock(reg.read_lock(path).with_entry(arch, op, entry), path)
    return entry


def unlock(reg: Registry, arch: str, op: str, path: str | Path | None = None) -> bool:
    current = reg.read_lock(path)
    if op not in current.section(arch):
        return False
    reg._write_lock(current.without(arch, op), path)
    return True


def _locked_archs(reg: Registry, op: str, name: str) -> list[str]:
    return [a for a, o, e in reg.read_lock().entries() if o == op and e.variant == name]


def accept(reg: Registry, op: str, name: str, arch: str | None = None,
           reason: str = "", lock_it: bool = True) -> Record:
    """Accept a variant: its proposed configs join configs/, it is locked for `arch` (default:
    the one arch it passed on), and every lock entry of it is pinned to the new configs."""
    rec = _require(reg, op, name)
    passed = [a for a, v in rec.verdicts().items() if v == "pass"]
    if not passed:
        raise RegistryError(f"{op}/{name} has no passing verification of its file (verdicts: "
                            f"{rec.verdicts() or 'none'}); only verified code can be accepted")
    if arch is None:
        if lock_it and len(passed) != 1:
            raise RegistryError(f"{op}/{name} passed verification on {passed or 'no arch'}: say "
                                "which arch to lock it for (--arch)")
        arch = passed[0] if lock_it else None
    if arch is not None and rec.verdict(arch) != "pass":
        raise RegistryError(f"{op}/{name} was verified for {passed or 'no arch'}, not {arch}; "
                            f"verify it on {arch} (autoopt registry record) before accepting it "
                            "there")
    configs = reg.read_configs(op, name).merged(rec.proposed_configs.entries)
    reason = reason or "accepted in review" + (f" for {arch}" if arch else "")
    rec = rec.replace(status="accepted", status_reason=reason,
                      proposed_configs=ConfigTable())
    rec = rec.with_review({"time": now_iso(), "action": "accept", "arch": arch,
                           "configs": configs.to_json()})
    reg._write_record(rec)
    reg._write_configs(op, name, configs)
    for a in _locked_archs(reg, op, name):
        if rec.verdict(a) == "pass":
            lock(reg, a, op, name)
    if lock_it and arch is not None:
        lock(reg, arch, op, name)
    return rec


def reject(reg: Registry, op: str, name: str, why: str) -> tuple[Record, list[str]]:
    """Reject with the reviewer's reason; returns the record and the archs it was unlocked for."""
    if not why.strip():
        raise RegistryError("reject needs a reason: --why 'what is wrong with it'")
    rec = _require(reg, op, name)
    rec = rec.replace(status="rejected", status_reason=why).with_review(
        {"time": now_iso(), "action": "reject", "why": why})
    reg._write_record(rec)
    unlocked = [a for a in _locked_archs(reg, op, name) if unlock(reg, a, op)]
    return rec, unlocked


def set_status(reg: Registry, op: str, name: str, status: str, reason: str = "") -> Record:
    """accepted (configs move in, nothing is locked), rejected (needs a reason), or candidate
    (back to review; unlocked wherever it was locked)."""
    if status not in STATUSES:
        raise RegistryError(f"status {status!r} is not one of {STATUSES}")
    if status == "accepted":
        return accept(reg, op, name, reason=reason, lock_it=False)
    if status == "rejected":
        return reject(reg, op, name, reason)[0]
    rec = _require(reg, op, name).replace(status="candidate", status_reason=reason).with_review(
        {"time": now_iso(), "action": "candidate", "why": reason})
    reg._write_record(rec)
    for a in _locked_archs(reg, op, name):
        unlock(reg, a, op)
    return rec
