"""Optimize runs as the review page reads them, linked to the variants they registered.

    runs/<run>/state.json, attempts.jsonl, report.md, plots/*.png, profile_*.png
    runs/<run>/ops/<op>/candidates/aNN_<hint>.py, aNN_<hint>.verify.json (the judge's reports)
    runs/<run>/ops/<op>/transcript.jsonl (the Claude agent: every request, reply, tool result)

A record names its run (`provenance.run`, the run directory's name) and its file's sha256; the
run's attempt with that op and sha256 is the one that produced it, and its outcome names the
variant it registered. Everything is read defensively: a run is data an agent's work wrote.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
STEM = re.compile(r"^[A-Za-z0-9_]{1,100}$")
REGISTERED = re.compile(r"registered (\w+)/(\w+)")
IMAGE_TYPES = {".png": "image/png", ".svg": "image/svg+xml"}
MARKERS = ("state.json", "attempts.jsonl", "report.md")
EXCERPT_ENTRIES = 8
EXCERPT_CHARS = 4000


class RunNotFound(LookupError):
    """A run, or a file in it, that is not there (or not a plain file inside the run)."""


def _jsonl(path: Path) -> Iterator[dict]:
    if not path.is_file():
        return
    for line in path.read_text(errors="replace").splitlines():
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            continue  # a run killed mid-write leaves half a line
        if isinstance(item, dict):
            yield item


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(errors="replace"))
    except (OSError, json.JSONDecodeError):
        return None


def registered_by(outcome: str | None) -> tuple[str, str] | None:
    """(op, variant) an attempt's outcome says it registered."""
    m = REGISTERED.search(outcome or "")
    return (m.group(1), m.group(2)) if m else None


@dataclass(frozen=True)
class Runs:
    """The runs directory (`--runs-dir`, default the one `autoopt optimize` writes to)."""

    root: Path

    def names(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted((d.name for d in self.root.iterdir()
                       if d.is_dir() and not d.is_symlink() and RUN_NAME.match(d.name)
                       and any((d / m).is_file() for m in MARKERS)), reverse=True)

    def path(self, run: str) -> Path:
        if not RUN_NAME.match(run or ""):
            raise RunNotFound(f"{run!r} is not a run name")
        d = self.root / run
        if d.is_symlink() or not d.is_dir():
            raise RunNotFound(f"no run {run} in {self.root}")
        return d

    def exists(self, run: str | None) -> bool:
        try:
            return run is not None and self.path(run) is not None
        except RunNotFound:
            return False

    def file(self, run: str, rel: str) -> Path:
        """A regular file inside the run, reached through no symlink."""
        base = self.path(run)
        parts = Path(rel).parts
        if not parts or any(p in ("..", "") or p.startswith(".") for p in parts):
            raise RunNotFound(f"{rel!r} is not a file of run {run}")
        cur = base
        for p in parts:
            cur = cur / p
            if cur.is_symlink():
                raise RunNotFound(f"{rel} in run {run} is a symlink")
        if not cur.is_file():
            raise RunNotFound(f"no file {rel} in run {run}")
        return cur

    # ---- what a run holds -------------------------------------------------------------------
    def state(self, run: str) -> dict:
        data = _json(self.path(run) / "state.json")
        return data if isinstance(data, dict) else {}

    def attempts(self, run: str) -> list[dict]:
        """Each attempt (index, op, candidate, sha256, verdict, reasons, timings, speedup,
        outcome, agent, notes) with its proposal and what it registered."""
        out = []
        for item in _jsonl(self.path(run) / "attempts.jsonl"):
            attempt = item.get("attempt") if isinstance(item.get("attempt"), dict) else {}
            proposal = item.get("proposal") if isinstance(item.get("proposal"), dict) else {}
            out.append({**attempt, "proposal": proposal,
                        "registered": registered_by(attempt.get("outcome"))})
        return out

    def summary(self, run: str) -> dict:
        state, attempts = self.state(run), self.attempts(run)
        args = state.get("args") if isinstance(state.get("args"), dict) else {}
        return {"run": run, "target": state.get("target"), "created": state.get("created"),
                "phase": state.get("phase"), "agent": args.get("agent"),
                "attempts": len(attempts),
                "passed": sum(a.get("verdict") == "pass" for a in attempts),
                "registered": [{"op": a["registered"][0], "variant": a["registered"][1],
                                "sha256": a.get("sha256")} for a in attempts if a["registered"]]}

    def report(self, run: str) -> str | None:
        path = self.path(run) / "report.md"
        return path.read_text(errors="replace") if path.is_file() else None

    def images(self, run: str) -> list[str]:
        base = self.path(run)
        found = [*sorted(base.glob("*")), *sorted((base / "plots").glob("*"))]
        return [str(p.relative_to(base)) for p in found
                if p.suffix in IMAGE_TYPES and p.is_file() and not p.is_symlink()]

    # ---- one variant's origin ---------------------------------------------------------------
    def attempt_for(self, run: str | None, op: str, sha256: str) -> dict | None:
        if not self.exists(run):
            return None
        found = [a for a in self.attempts(run) if a.get("op") == op
                 and a.get("sha256") == sha256]
        return found[-1] if found else None

    def verify_reports(self, run: str, op: str, candidate: str) -> list[dict]:
        """The judge's full reports of a run's candidate (one per config verified)."""
        if not STEM.match(candidate or "") or not STEM.match(op or ""):
            return []
        data = _json(self.path(run) / "ops" / op / "candidates" / f"{candidate}.verify.json")
        items = data if isinstance(data, list) else [data] if isinstance(data, dict) else []
        return [r for r in items if isinstance(r, dict)]

    def has_candidate(self, run: str, op: str, candidate: str | None) -> bool:
        try:
            return self.candidate_source(run, op, str(candidate)) is not None
        except RunNotFound:
            return False

    def candidate_source(self, run: str, op: str, candidate: str) -> str:
        if not STEM.match(candidate or "") or not STEM.match(op or ""):
            raise RunNotFound(f"{op}/{candidate} is not a candidate name")
        return self.file(run, f"ops/{op}/candidates/{candidate}.py").read_text(errors="replace")

    def transcript_excerpt(self, run: str, op: str, sha256: str) -> list[dict]:
        """What the agent said and did up to the submission the harness judged as `sha256`:
        the session's entries after the previous submission, the last few kept, each cut."""
        if not STEM.match(op or "") or not self.exists(run):
            return []
        entries = list(_jsonl(self.path(run) / "ops" / op / "transcript.jsonl"))
        end = next((i for i, e in enumerate(entries) if e.get("kind") == "harness_feedback"
                    and (e.get("attempt") or {}).get("sha256") == sha256), None)
        if end is None:
            return []
        start = max((i + 1 for i, e in enumerate(entries[:end])
                     if e.get("kind") in ("harness_feedback", "session_start")), default=0)
        picked = [_excerpt_entry(e) for e in entries[start:end + 1]]
        return [p for p in picked if p["text"]][-EXCERPT_ENTRIES:]


def _cut(text: str) -> str:
    return text if len(text) <= EXCERPT_CHARS else text[:EXCERPT_CHARS] + "\n[... cut]"


def _excerpt_entry(e: dict) -> dict:
    kind = str(e.get("kind"))
    if kind == "response":
        parts = []
        for block in e.get("content") or []:
            if not isinstance(block, dict):
                continue
            if block.get("type") == "text":
                parts.append(str(block.get("text", "")))
            elif block.get("type") == "tool_use":
                args = dict(block.get("input") or {})
                if "source" in args:
                    args["source"] = f"<{len(str(args['source']))} characters of source>"
                parts.append(f"[tool {block.get('name')}] {json.dumps(args, default=str)}")
        return {"kind": "agent", "time": e.get("time"), "text": _cut("\n\n".join(parts))}
    if kind == "tool_result":
        return {"kind": "tool result", "time": e.get("time"),
                "text": _cut(str(e.get("content", "")))}
    if kind == "harness_feedback":
        a = e.get("attempt") or {}
        text = f"verdict {a.get('verdict')}; speedup {a.get('speedup')}; {a.get('outcome')}"
        return {"kind": "harness", "time": e.get("time"), "text": text}
    if kind == "api_error":
        return {"kind": "api error", "time": e.get("time"), "text": str(e.get("message", ""))}
    return {"kind": kind, "time": e.get("time"), "text": ""}
