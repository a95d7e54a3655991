"""`autoopt registry list|show|diff|lock|set-status`: read and curate a kernel registry.

The store itself (paths, records, hashes, the lock) is `model.registry.Registry`; this module
only renders it and turns refusals into messages and exit codes (0 ok, 1 refused or a problem).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from model.registry import Registry, RegistryError, current_arch, sha256

from .env import registry_dir


@dataclass(frozen=True)
class RegistryArgs:
    root: Path | None = None
    op: str | None = None
    variant: str | None = None
    other: str | None = None
    arch: str | None = None
    unset: bool = False
    lock_file: Path | None = None
    status: str | None = None
    reason: str = ""
    as_json: bool = False


def run_registry(command: str, args: RegistryArgs, console: Console) -> int:
    reg = Registry(args.root or registry_dir())
    handlers = {"list": _list, "show": _show, "diff": _diff, "lock": _lock,
                "set-status": _set_status}
    try:
        return handlers[command](reg, args, console)
    except RegistryError as exc:
        Console(stderr=True).print(f"[red]error:[/] {exc}", highlight=False)
        return 1


def file_state(reg: Registry, op: str, variant: str, rec: dict | None) -> str:
    path = reg.variant_path(op, variant)
    if not path.is_file():
        return "missing"
    if rec is None or not rec.get("sha256"):
        return "unrecorded"
    return "ok" if sha256(path) == rec["sha256"] else "MODIFIED"


def _locked_in(reg: Registry, op: str, variant: str) -> list[str]:
    out = []
    for arch in sorted(reg.read_lock()):
        entry = reg.lock(arch).get(op)
        if entry and entry.variant == variant:
            ok = reg.variant_path(op, variant).is_file() and \
                sha256(reg.variant_path(op, variant)) == entry.sha256
            out.append(arch if ok else f"{arch}(!)")
    return out


def _best_speedup(rec: dict) -> str:
    ratios = [b.get("x_reference") for b in rec.get("benchmarks", [])
              if b.get("meaningful") and b.get("x_reference")]
    return f"{max(ratios):.2f}x" if ratios else "-"


def _verdicts(rec: dict) -> str:
    ver = rec.get("verification") or {}
    return " ".join(f"{arch}:{(v or {}).get('verdict', '?')}" for arch, v in sorted(ver.items()))


def _list(reg: Registry, args: RegistryArgs, console: Console) -> int:
    table = Table(title=f"kernel registry {reg.root}")
    for col in ("op", "variant", "status", "file", "sha256", "locked", "verified", "best x ref"):
        table.add_column(col, overflow="fold")
    problems = 0
    for op in [args.op] if args.op else reg.ops():
        names = sorted(set(reg.variants(op)) | {p.stem for p in (reg.root / op / "records")
                                                .glob("*.json")})
        for name in names:
            rec = reg.read_record(op, name)
            state = file_state(reg, op, name, rec)
            problems += state in ("MODIFIED", "missing")
            path = reg.variant_path(op, name)
            digest = sha256(path)[:12] if path.is_file() else "-"
            style = "red" if state in ("MODIFIED", "missing") else None
            table.add_row(op, name, (rec or {}).get("status", "-"), f"[{style}]{state}[/]"
                          if style else state, digest, " ".join(_locked_in(reg, op, name)) or "-",
                          _verdicts(rec or {}) or "-", _best_speedup(rec or {}))
    console.print(table)
    for p in reg.check_immutable():
        console.print(f"[red]{p.op}/{p.variant}: {p.kind}[/] ({p.detail}); recorded variants are "
                      "immutable: restore the file or record the new code as a new variant")
    return 1 if problems else 0


def _show(reg: Registry, args: RegistryArgs, console: Console) -> int:
    op, name = args.op, args.variant
    rec = reg.read_record(op, name)
    path = reg.variant_path(op, name)
    if rec is None and not path.is_file():
        raise RegistryError(f"no variant {op}/{name} in {reg.root}")
    if args.as_json:
        console.print_json(json.dumps(rec or {}, default=str))
        return 0
    rec = rec or {}
    state = file_state(reg, op, name, rec or None)
    console.print(f"[bold]{op}/{name}[/]  {path}")
    console.print(f"file {state}; sha256 {sha256(path) if path.is_file() else '-'}")
    console.print(f"status {rec.get('status', 'unrecorded')}"
                  + (f" ({rec['status_reason']})" if rec.get("status_reason") else ""))
    prov = rec.get("provenance") or {}
    if prov:
        console.print("provenance " + ", ".join(f"{k}={v}" for k, v in prov.items() if v))
    for arch, v in sorted((rec.get("verification") or {}).items()):
        v = v or {}
        console.print(f"verified on {arch}: {v.get('verdict', '?')} ({len(v.get('shapes', []))} "
                      f"shapes x {len(v.get('seeds', []))} seeds, device {v.get('device', '?')})")
        for reason in v.get("reasons", [])[:5]:
            console.print(f"  - {reason}", highlight=False)
    if rec.get("benchmarks"):
        console.print(bench_table(rec["benchmarks"], f"benchmarks of {op}/{name}"))
    configs = reg.read_configs(op, name)
    for gpu, buckets in sorted(configs.items()):
        console.print(f"tuned configs for {gpu}: " + ", ".join(
            f"{b} {json.dumps(c)}" for b, c in buckets.items()), highlight=False)
    return 1 if state in ("MODIFIED", "missing") else 0


def bench_table(rows: list[dict[str, Any]], title: str) -> Table:
    table = Table(title=title)
    for col in ("target", "gpu", "shape", "median us", "IQR", "x ref", "x compile", "% floor"):
        table.add_column(col, justify="right" if col not in ("target", "gpu", "shape") else "left")
    for b in rows:
        shape = ",".join(f"{k}={v}" for k, v in (b.get("shape") or {}).items())
        xc = b.get("x_compile")
        mark = "" if b.get("meaningful", True) else " (cpu)"
        table.add_row(str(b.get("target", "-")), str(b.get("gpu") or b.get("device", "-")) + mark,
                      shape, f"{b.get('median_us', 0):.2f}", f"{b.get('iqr_us', 0):.2f}",
                      f"{b.get('x_reference', 0):.2f}", f"{xc:.2f}" if xc else "-",
                      f"{b.get('pct_of_floor', 0):.0f}")
    return table


def _diff(reg: Registry, args: RegistryArgs, console: Console) -> int:
    op, a, b = args.op, args.variant, args.other
    texts = []
    for name in (a, b):
        path = reg.variant_path(op, name)
        if not path.is_file():
            raise RegistryError(f"no variant file {path}")
        texts.append(path.read_text().splitlines(keepends=True))
    diff = difflib.unified_diff(texts[0], texts[1], f"{op}/{a}.py", f"{op}/{b}.py")
    console.print("".join(diff) or "(identical sources)", highlight=False, markup=False)
    table = Table(title=f"{op}: {a} vs {b}")
    for col in ("", a, b):
        table.add_column(col)
    recs = [reg.read_record(op, n) or {} for n in (a, b)]
    table.add_row("status", *(r.get("status", "unrecorded") for r in recs))
    table.add_row("verified", *(_verdicts(r) or "-" for r in recs))
    table.add_row("best x ref", *(_best_speedup(r) for r in recs))
    keyed = [{(x.get("gpu"), json.dumps(x.get("shape"), sort_keys=True)): x
              for x in r.get("benchmarks", [])} for r in recs]
    for key in sorted(set(keyed[0]) & set(keyed[1]), key=str):
        table.add_row(f"{key[0]} {key[1]} us",
                      *(f"{k[key].get('median_us', 0):.2f}" for k in keyed))
    console.print(table)
    return 0


def _lock(reg: Registry, args: RegistryArgs, console: Console) -> int:
    arch = args.arch or current_arch()
    if args.op and args.unset:
        removed = reg.unset_lock(arch, args.op, args.lock_file)
        console.print(f"[{arch}] {args.op}: " + ("removed (runs the reference)" if removed
                                                 else "was not locked"), markup=False)
        return 0
    if args.op:
        if not args.variant:
            raise RegistryError("--op needs --variant NAME (or --unset)")
        entry = reg.set_lock(arch, args.op, args.variant, args.lock_file)
        console.print(f"[{arch}] {args.op} = {entry.variant} (sha256 {entry.sha256[:12]})",
                      markup=False)
        return 0
    lock_path = args.lock_file or reg.lock_path
    table = Table(title=f"lock {lock_path}")
    for col in ("arch", "op", "variant", "sha256", "state"):
        table.add_column(col)
    bad = 0
    for section in sorted(reg.read_lock(lock_path)):
        for op, entry in sorted(reg.lock(section, lock_path).items()):
            path = reg.variant_path(op, entry.variant)
            rec = reg.read_record(op, entry.variant) or {}
            state = ("missing" if not path.is_file() else "MODIFIED"
                     if sha256(path) != entry.sha256 else rec.get("status", "unrecorded"))
            bad += state != "accepted"
            table.add_row(section, op, entry.variant, entry.sha256[:12], state)
    console.print(table)
    return 1 if bad else 0


def _set_status(reg: Registry, args: RegistryArgs, console: Console) -> int:
    rec = reg.set_status(args.op, args.variant, args.status, args.reason)
    console.print(f"{args.op}/{args.variant}: {rec['status']}"
                  + (f" ({args.reason})" if args.reason else ""))
    return 0
