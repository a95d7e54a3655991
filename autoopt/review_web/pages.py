"""What each page shows, read through the same functions as `autoopt registry ...`.

The overview's row of a variant is `registry list`'s row (`registry_cmd.listing_row`), the
variant page's diff base is `registry show`'s (`registry_show.selected_source`), the lock's state
is `registry lock`'s (`registry_cmd.lock_rows`); this module only adds what a page shows beside
them (per-bucket speed-ups, evidence laid out, the run that produced a variant). A record that
cannot be read is shown as broken, with the reader's message, never as a crash.
"""

from __future__ import annotations

from typing import Any

from model.registry import Record, Registry, RegistryError

from .. import registry_cmd, registry_show
from . import evidence
from .markup import render
from .runs import RunNotFound, Runs
from .sources import highlight_lines, side_by_side


class NotFound(LookupError):
    """A page for something that does not exist (404)."""


def overview(reg: Registry, runs: Runs) -> dict[str, Any]:
    if not reg.root.is_dir():
        raise NotFound(f"no registry at {reg.root} (pass --registry DIR)")
    try:
        lock = registry_cmd.lock_rows(reg)
    except RegistryError as exc:  # no lock file, or one that is not TOML
        lock = [{"arch": "-", "op": "-", "variant": "-", "sha256": "-", "configs": "-",
                 "state": str(exc)}]
    ops = []
    for op in reg.ops():
        rows = [_overview_row(reg, op, name) for name in reg.names(op)]
        ops.append({"op": op, "rows": rows, "lock": [r for r in lock if r["op"] == op]})
    problems = [f"{p.op}/{p.variant}: {p.kind} ({p.detail})" for p in _problems(reg)]
    pending = [r for o in ops for r in o["rows"] if r["status"] == "candidate"]
    return {"ops": ops, "lock": lock, "lock_other": [r for r in lock if r["op"] == "-"],
            "problems": problems, "pending": pending, "registry": str(reg.root),
            "runs": runs.names()[:10]}


def _problems(reg: Registry) -> list:
    try:
        return reg.check_immutable()
    except RegistryError:
        return []


def _overview_row(reg: Registry, op: str, name: str) -> dict[str, Any]:
    try:
        rec = reg.read_record(op, name)
        row = registry_cmd.listing_row(reg, op, name, rec)
    except RegistryError as exc:
        return {"op": op, "variant": name, "status": "broken", "error": str(exc),
                "verdicts": {}, "speed": []}
    row["verdicts"] = rec.verdicts() if rec else {}
    row["speed"] = evidence.bucket_speedups(rec) if rec else []
    return row


def diff_base(reg: Registry, rec: Record, arch: str) -> tuple[str, str, Record | None]:
    """(label, source, record) of what `rec` would replace on `arch`: the locked variant, or the
    op's reference (itself locked: the reference, as it replaces nothing)."""
    label, source = registry_show.selected_source(reg, rec.op, arch, skip=rec.name)
    current = None
    if label != "reference":
        try:
            current = reg.read_record(rec.op, label)
        except RegistryError:
            current = None
    return label, source, current


def _record(reg: Registry, op: str, name: str, arch: str | None) -> tuple[Record, str, list]:
    """The record, the arch the page compares on (default: the first it passed on, as
    `registry show` does) and the archs it passed on."""
    rec = reg.read_record(op, name)
    if rec is None:
        known = ", ".join(reg.names(op)) if (reg.root / op).is_dir() else "none"
        raise NotFound(f"no record for {op}/{name} in {reg.root}; variants of {op}: {known}")
    passed = [a for a, v in rec.verdicts().items() if v == "pass"]
    return rec, arch or (passed[0] if passed else "cpu"), passed


def timings(reg: Registry, op: str, name: str, arch: str | None
            ) -> tuple[list[evidence.TimingGroup], str]:
    """The variant's timing groups beside what it would replace on `arch`, and that one's
    label (what the plots draw)."""
    rec, arch, _ = _record(reg, op, name, arch)
    label, _, current = diff_base(reg, rec, arch)
    return evidence.timing_groups(rec, current), label


def variant(reg: Registry, runs: Runs, op: str, name: str, arch: str | None) -> dict[str, Any]:
    rec, arch, passed = _record(reg, op, name, arch)
    state = registry_show.file_state(reg, op, name, rec)
    source = reg.read_variant(op, name)[1].decode() if state in ("ok", "MODIFIED") else ""
    base_label, base_source, current = diff_base(reg, rec, arch)
    locked = registry_show.locked_in(reg, op, name)
    run = rec.provenance.run
    attempt = runs.attempt_for(run, op, rec.variant.sha256)
    return {
        "rec": rec, "op": op, "name": name, "arch": arch, "passed": passed, "file": state,
        "archs": sorted({*rec.verification, *(a for a, _, _ in reg.read_lock().entries())}),
        "locked": locked, "row": registry_cmd.listing_row(reg, op, name, rec),
        "diff": side_by_side(base_source, source, f"{op}/{base_label} (selected for {arch})",
                             f"{op}/{name}"),
        "base_label": base_label, "source_lines": highlight_lines(source),
        "evidence": evidence.verification(rec, runs),
        "timings": evidence.timing_groups(rec, current),
        "profile": evidence.profile_rows(rec),
        "configs": registry_show.config_lines(reg, rec),
        "notes": [render(e) for e in reg.notes_entries(op, name)],
        "run": run, "run_found": runs.exists(run), "attempt": attempt,
        "attempt_source": bool(attempt) and runs.has_candidate(run, op, attempt.get("candidate")),
        "transcript": runs.transcript_excerpt(run, op, rec.variant.sha256) if run else [],
        "optimize": dict(rec.optimize or {}),
        "review": [dict(r) for r in rec.review],
        "can_accept": bool(passed) and rec.status != "accepted",
        "can_reject": rec.status != "rejected",
        "lockable": [a for a in passed if a not in locked] if rec.status == "accepted" else [],
    }


def runs_index(reg: Registry, runs: Runs) -> dict[str, Any]:
    summaries = [runs.summary(r) for r in runs.names()]
    for s in summaries:
        for r in s["registered"]:
            r["link"] = _registered_link(reg, (r["op"], r["variant"]), r["sha256"])
    return {"runs": summaries, "root": str(runs.root)}


def run(reg: Registry, runs: Runs, name: str) -> dict[str, Any]:
    try:
        runs.path(name)
    except RunNotFound as exc:
        raise NotFound(str(exc)) from None
    report = runs.report(name)
    base = f"/runs/{name}/files"
    attempts = runs.attempts(name)
    for a in attempts:
        a["link"] = _registered_link(reg, a.get("registered"), a.get("sha256"))
        a["has_source"] = runs.has_candidate(name, str(a.get("op")), a.get("candidate"))
    produced = _produced(reg, name)
    return {"run": name, "summary": runs.summary(name), "state": runs.state(name),
            "report": render(report, base) if report else None, "attempts": attempts,
            "images": runs.images(name), "produced": produced}


def _registered_link(reg: Registry, registered: tuple[str, str] | None, sha256: str | None
                     ) -> str | None:
    """The page of the variant an attempt registered, when this registry holds those bytes
    under that name (another registry's variant of the same name is another variant)."""
    if not registered:
        return None
    op, name = registered
    try:
        rec = reg.read_record(op, name)
    except RegistryError:
        return None
    return f"/variant/{op}/{name}" if rec is not None and rec.variant.sha256 == sha256 else None


def _produced(reg: Registry, run: str) -> list[dict]:
    """Variants in this registry whose record names this run."""
    out = []
    for op in reg.ops():
        for name in reg.names(op):
            try:
                rec = reg.read_record(op, name)
            except RegistryError:
                continue
            if rec is not None and rec.provenance.run == run:
                out.append({"op": op, "variant": name, "status": rec.status,
                            "verified": registry_cmd.verdict_text(rec)})
    return out


def candidate_file(runs: Runs, run: str, op: str, candidate: str) -> dict[str, Any]:
    """A run's candidate file (rejected ones included), with its attempt."""
    try:
        source = runs.candidate_source(run, op, candidate)
    except RunNotFound as exc:
        raise NotFound(str(exc)) from None
    attempt = next((a for a in runs.attempts(run)
                    if a.get("op") == op and a.get("candidate") == candidate), None)
    return {"run": run, "op": op, "candidate": candidate, "lines": highlight_lines(source),
            "attempt": attempt, "reports": runs.verify_reports(run, op, candidate)}
