"""A record's evidence laid out for the page: verification per arch and shape, timings per bucket.

Nothing here judges: verdicts are the record's (`Record.verdict`), numbers are the judge's and the
timer's as recorded. Where a record keeps a slim report (the optimize loop keeps no per-shape
detail in the registry), the per-shape rows come from the run's full report of the same file
(`runs/<run>/ops/<op>/candidates/<candidate>.verify.json`) and say so.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from model.registry import Record

from .runs import Runs

CHECK_ORDER = ("static_screen", "sandbox", "import", "numerics", "near_misses", "behaviour",
               "floor")


def _fmt_shape(shape: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in shape.items())


def _thaw(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _thaw(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_thaw(v) for v in x]
    return x


@dataclass(frozen=True)
class ShapeRow:
    shape: str
    seed: Any
    outputs: list[dict]
    near: list[dict]


@dataclass(frozen=True)
class Entry:
    """One verification of one file on one arch."""

    verdict: str
    device: str | None
    config: dict
    this_file: bool
    sha256: str
    reasons: list[str]
    checks: list[dict]
    outputs: list[dict]
    contract: dict
    near_misses: list[dict]
    guards: dict
    env: dict
    seeds: list
    shapes: list[str]
    elapsed_s: float | None
    per_shape: list[ShapeRow] = field(default_factory=list)
    per_shape_from: str | None = None


@dataclass(frozen=True)
class ArchEvidence:
    arch: str
    verdict: str
    entries: list[Entry]


def _check_rows(checks: Mapping[str, Any]) -> list[dict]:
    rows = []
    for name in [*CHECK_ORDER, *sorted(set(checks) - set(CHECK_ORDER))]:
        c = checks.get(name)
        if not isinstance(c, Mapping) or name == "method":
            continue
        passed = c.get("passed")
        if passed is None and name == "sandbox":
            passed = c.get("returncode") == 0 and not c.get("timed_out")
        if passed is None and name == "behaviour":
            passed = not c.get("failed")
        detail = {k: v for k, v in c.items() if k not in ("passed", "outputs", "by_name")}
        rows.append({"name": name, "passed": passed,
                     "detail": json.dumps(_thaw(detail), default=str)[:600]})
    return rows


def _count(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return 0


def _hist_rows(hist: Mapping[str, Any] | None) -> list[dict]:
    counts = {str(k): _count(v) for k, v in (hist or {}).items()}
    total = sum(counts.values()) or 1
    keyed = sorted(counts.items(), key=lambda kv: (not kv[0].lstrip("-").isdigit(),
                                                   abs(int(kv[0])) if kv[0].lstrip("-")
                                                   .isdigit() else 0, kv[0]))
    return [{"ulp": k, "count": n, "fraction": n / total} for k, n in keyed]


def _outputs(outputs: Sequence[Mapping[str, Any]]) -> list[dict]:
    out = []
    for i, o in enumerate(outputs):
        o = _thaw(o)
        out.append({"index": i, **o, "hist_rows": _hist_rows(o.get("hist"))})
    return out


def _near_rows(by_name: Mapping[str, Any]) -> list[dict]:
    return [{"name": n, **_thaw(d)} for n, d in by_name.items() if isinstance(d, Mapping)]


def _shape_rows(per_shape: Sequence[Mapping[str, Any]]) -> list[ShapeRow]:
    rows = []
    for r in per_shape:
        if not isinstance(r, Mapping):
            continue
        near = _near_rows(r.get("near_miss") or {})
        rows.append(ShapeRow(_fmt_shape(r.get("shape") or {}), r.get("seed"),
                             _outputs(r.get("outputs") or []), near))
    return rows


def _run_per_shape(rec: Record, config: Mapping | None, runs: Runs | None
                   ) -> tuple[list, str | None]:
    run = rec.provenance.run
    if runs is None or not runs.exists(run):
        return [], None
    attempt = runs.attempt_for(run, rec.op, rec.variant.sha256)
    if attempt is None:
        return [], None
    cand = str(attempt.get("candidate"))
    reports = [r for r in runs.verify_reports(run, rec.op, cand)
               if r.get("sha256") == rec.variant.sha256]
    same = [r for r in reports if (r.get("config") or None) == (_thaw(config) or None)]
    for r in same or reports[:1]:
        return list(r.get("per_shape") or []), f"run {run}: ops/{rec.op}/candidates/{cand}"
    return [], None


def entry(rec: Record, v: Any, runs: Runs | None) -> Entry:
    r = v.report
    checks = r.get("checks") or {}
    numerics = checks.get("numerics") or {}
    per_shape, source = list(r.get("per_shape") or []), "record" if r.get("per_shape") else None
    if not per_shape:
        per_shape, source = _run_per_shape(rec, v.config, runs)
    guards = {"method": _thaw(checks.get("method") or {}),
              "blocked": _thaw((checks.get("sandbox") or {}).get("blocked") or []),
              "behaviour": _thaw(checks.get("behaviour") or {})}
    # A config per bucket (judged call by call, as served) shows as its table.
    config = _thaw(v.config) or _thaw(r.get("configs") or {}) or {}
    return Entry(v.verdict, v.device, config, v.sha256 == rec.variant.sha256,
                 v.sha256, list(v.reasons), _check_rows(checks),
                 _outputs(numerics.get("outputs") or []), _thaw(numerics.get("contract") or {}),
                 _near_rows((checks.get("near_misses") or {}).get("by_name") or {}), guards,
                 _thaw(r.get("env") or {}), _thaw(r.get("seeds") or []),
                 [_fmt_shape(s) for s in r.get("shapes") or [] if isinstance(s, Mapping)],
                 r.get("elapsed_s"), _shape_rows(per_shape), source)


def verification(rec: Record, runs: Runs | None = None) -> list[ArchEvidence]:
    return [ArchEvidence(arch, rec.verdict(arch), [entry(rec, v, runs) for v in vs])
            for arch, vs in rec.verification.items()]


# ---- timings ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class TimingGroup:
    """Benchmark rows of one GPU, target and fixed per-rank dims, by token bucket."""

    gpu: str
    target: str
    dims: str
    meaningful: bool
    rows: list[dict]

    @property
    def title(self) -> str:
        return " · ".join(x for x in (self.gpu, self.target, self.dims) if x)


def _key(b: Any) -> tuple[str, str, str]:
    dims = {k: v for k, v in b.shape.items() if k != "T"}
    return (str(b.gpu or b.get("device") or "?"), str(b.get("target") or "-"),
            _fmt_shape(dims))


def timing_groups(rec: Record, current: Record | None) -> list[TimingGroup]:
    """`current`: the record of what the candidate would replace (its time per bucket, same GPU
    and shape), None when that is the reference (timed in every row)."""
    cur: dict[tuple, Any] = {}
    for b in current.benchmarks if current is not None else ():
        cur[(_key(b), json.dumps(_thaw(b.shape), sort_keys=True))] = b
    groups: dict[tuple, list] = {}
    for b in rec.benchmarks:
        groups.setdefault(_key(b), []).append(b)
    out = []
    for key, rows in groups.items():
        rows = sorted(rows, key=lambda b: b.shape.get("T", 0))
        mine = [(b, cur.get((key, json.dumps(_thaw(b.shape), sort_keys=True)))) for b in rows]
        out.append(TimingGroup(*key, all(b.meaningful for b in rows),
                               [_timing_row(b, c) for b, c in mine]))
    return out


def _timing_row(b: Any, current: Any) -> dict:
    """One bucket; torch.compile of the reference, when the candidate's run did not time it,
    is taken from the current variant's row of the same GPU and shape (marked)."""
    compile_us, compile_from = b.get("compile_us"), None
    if compile_us is None and current is not None and current.get("compile_us") is not None:
        compile_us, compile_from = current.get("compile_us"), "current"
    return {"T": b.shape.get("T"), "shape": _fmt_shape(b.shape),
            "median_us": b.get("median_us"), "iqr_us": b.get("iqr_us"),
            "reference_us": b.get("reference_us"), "compile_us": compile_us,
            "compile_from": compile_from,
            "current_us": current.get("median_us") if current is not None else None,
            "floor_us": b.get("floor_us"), "x_reference": b.get("x_reference"),
            "x_compile": b.get("x_compile"), "pct_of_floor": b.get("pct_of_floor"),
            "config": _thaw(b.get("config") or {}), "method": b.get("method"),
            "meaningful": b.meaningful}


def bucket_speedups(rec: Record) -> list[dict]:
    """Per GPU with meaningful timings: x reference and % of floor per token bucket."""
    return [{"gpu": g.title, "cells": [{"T": r["T"], "x": r["x_reference"],
                                        "pct": r["pct_of_floor"]} for r in g.rows]}
            for g in timing_groups(rec, None) if g.meaningful]


def profile_rows(rec: Record) -> list[dict]:
    """What the optimize loop's profile saw for the op (Nsight Compute when `bytes_source` is
    ncu), and any Nsight metrics kept in the record."""
    out = []
    opt = _thaw(rec.optimize or {})
    row = opt.get("profile_row")
    if isinstance(row, Mapping) and row:
        measured = "Nsight Compute" if row.get("bytes_source") == "ncu" else "profile"
        out.append({"title": f"{measured}: the op before this variant", "metrics": row})
    for where, found in _nsight(_thaw(rec.to_json())):
        out.append({"title": f"Nsight metrics ({where})", "metrics": found})
    return out


def _nsight(obj: Any, where: str = "") -> list[tuple[str, dict]]:
    found = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            path = f"{where}.{k}" if where else k
            if k in ("nsight", "ncu", "ncu_metrics") and isinstance(v, dict) and v:
                found.append((path, v))
            else:
                found += _nsight(v, path)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            found += _nsight(v, f"{where}[{i}]")
    return found


def fmt(x: Any, digits: int = 2) -> str:
    """Numbers as the page prints them ('-' for missing, no 'nan')."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}f}" if abs(x) >= 10 ** -digits or x == 0 else f"{x:.2e}"
    return str(x)
