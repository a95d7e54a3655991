"""`autoopt registry ...` (alias `autoopt review ...`): read, review and curate a registry.

list, show, diff, record, accept, reject, set-status, lock, migrate. The store, the records and
every write are `model.registry`'s; this module renders them and turns refusals into messages
and exit codes (0 ok, 1 refused or a problem found, 2 bad input).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from model.registry import Record, Registry, RegistryError, current_arch, writers

from . import env
from .console import make_console
from .registry_show import file_state, locked_in, show_text


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
    handlers: dict[str, Callable[[Registry, RegistryArgs, Console], int]] = {
        "list": _list, "show": _show, "diff": _diff, "lock": _lock, "set-status": _set_status,
        "accept": _accept, "reject": _reject, "migrate": _migrate}
    try:
        reg = env.open_registry(args.root)
        return handlers[command](reg, args, console)
    except RegistryError as exc:
        make_console(stderr=True).print(f"[red]error:[/] {exc}", highlight=False)
        return 1


def _require_root(reg: Registry) -> None:
    if not reg.root.is_dir():
        raise RegistryError(f"no registry at {reg.root} (pass --registry DIR, or set "
                            "AUTOOPT_REGISTRY)")


def best_speedup(rec: Record) -> str:
    ratios = [b.x_reference for b in rec.benchmarks if b.meaningful and b.x_reference]
    return f"{max(ratios):.2f}x" if ratios else "-"


def verdict_text(rec: Record | None) -> str:
    """Per-arch verdicts, as every listing shows them (registry list, review list, the page)."""
    if rec is None:
        return "-"
    return " ".join(f"{a}:{v}" for a, v in rec.verdicts().items()) or "unverified"


def listing(reg: Registry, op: str | None = None, status: str | None = None) -> list[dict]:
    """One row per variant with a file or a record: what `list` prints (and tests compare)."""
    _require_root(reg)
    rows = []
    for o in [op] if op else reg.ops():
        for name in reg.names(o):
            rec = reg.read_record(o, name)
            if status and (rec is None or rec.status != status):
                continue
            rows.append(listing_row(reg, o, name, rec))
    return rows


def listing_row(reg: Registry, op: str, name: str, rec: Record | None) -> dict:
    """One variant's row of `list` (the review page shows the same row)."""
    return {
        "op": op, "variant": name, "status": rec.status if rec else "unrecorded",
        "language": rec.variant.language if rec else "-",
        "agent": rec.provenance.agent if rec else "-",
        "file": file_state(reg, op, name, rec),
        "sha256": rec.variant.sha256[:12] if rec else "-",
        "locked": " ".join(locked_in(reg, op, name)) or "-",
        "verified": verdict_text(rec), "best x ref": best_speedup(rec) if rec else "-",
        "proposed configs": len(rec.proposed_configs.entries) if rec else 0}


def _list(reg: Registry, args: RegistryArgs, console: Console) -> int:
    rows = listing(reg, args.op, args.status)
    if args.as_json:
        console.print_json(json.dumps(rows))
    else:
        title = f"{args.status or 'all'} variants in {reg.root}"
        table = Table(title=title)
        # "proposed configs": tuned configs waiting for `accept` (an accepted variant too).
        cols = ("op", "variant", "status", "language", "agent", "file", "locked", "verified",
                "best x ref", "proposed configs")
        for col in cols:
            # Names are what a reviewer types next: never cut them.
            table.add_column(col, no_wrap=col in ("op", "variant"), overflow="fold")
        for r in rows:
            bad = r["file"] in ("MODIFIED", "missing", "unsafe")
            table.add_row(*(f"[red]{r[c]}[/]" if bad and c == "file" else str(r[c] or "-")
                            for c in cols))
        console.print(table if rows else f"no {args.status or ''} variants in {reg.root}")
    problems = reg.check_immutable()
    for p in problems:
        console.print(f"[red]{p.op}/{p.variant}: {p.kind}[/] ({p.detail}); recorded variants are "
                      "immutable: restore the file or record the new code as a new variant",
                      highlight=False)
    return 1 if problems else 0


def _show(reg: Registry, args: RegistryArgs, console: Console) -> int:
    _require_root(reg)
    rec = reg.read_record(args.op, args.variant)
    if args.as_json:
        if rec is None:
            raise RegistryError(f"no record for {args.op}/{args.variant} in {reg.root}")
        console.print_json(json.dumps(rec.to_json(), default=str))
        return 0
    text = show_text(reg, args.op, args.variant, args.arch)
    if console.is_terminal:
        from rich.markdown import Markdown

        console.print(Markdown(text))
    else:
        console.print(text, markup=False, highlight=False, soft_wrap=True)
    return 1 if file_state(reg, args.op, args.variant, rec) != "ok" else 0


def _diff(reg: Registry, args: RegistryArgs, console: Console) -> int:
    op, a, b = args.op, args.variant, args.other
    texts = [reg.read_variant(op, n)[1].decode().splitlines(keepends=True) for n in (a, b)]
    diff = difflib.unified_diff(texts[0], texts[1], f"{op}/{a}.py", f"{op}/{b}.py")
    console.print("".join(diff) or "(identical sources)", highlight=False, markup=False)
    table = Table(title=f"{op}: {a} vs {b}")
    for col in ("", a, b):
        table.add_column(col)
    recs = [reg.read_record(op, n) for n in (a, b)]
    table.add_row("status", *(r.status if r else "unrecorded" for r in recs))
    table.add_row("verified", *(verdict_text(r) for r in recs))
    table.add_row("best x ref", *(best_speedup(r) if r else "-" for r in recs))
    keyed = [{(x.gpu, json.dumps(dict(x.shape), sort_keys=True)): x
              for x in (r.benchmarks if r else ())} for r in recs]
    for key in sorted(set(keyed[0]) & set(keyed[1]), key=str):
        table.add_row(f"{key[0]} {key[1]} us",
                      *(f"{k[key].get('median_us') or 0:.2f}" for k in keyed))
    console.print(table)
    return 0


def _lock(reg: Registry, args: RegistryArgs, console: Console) -> int:
    arch = args.arch or current_arch()
    if args.op and args.unset:
        removed = writers.unlock(reg, arch, args.op, args.lock_file)
        console.print(f"[{arch}] {args.op}: " + ("removed (runs the reference)" if removed
                                                 else "was not locked"), markup=False)
        return 0
    if args.op:
        if not args.variant:
            raise RegistryError("--op needs --variant NAME (or --unset)")
        e = writers.lock(reg, arch, args.op, args.variant, args.lock_file)
        console.print(f"[{arch}] {args.op} = {e.variant} (sha256 {e.sha256[:12]}, configs "
                      f"{e.configs_sha256[:12]})", markup=False)
        return 0
    return _show_lock(reg, args, console)


def lock_rows(reg: Registry, lock_file: Path | None = None) -> list[dict]:
    """Every lock entry with its state: what the runtime would do with it on its arch."""
    from model.registry.runtime import check_evidence

    lock = reg.read_lock(lock_file, missing_ok=False)
    rows = []
    for arch, op, e in lock.entries():
        found = check_evidence(reg, op, e, arch)
        state = "ok" if not isinstance(found, str) else found
        rows.append({"arch": arch, "op": op, "variant": e.variant, "sha256": e.sha256[:12],
                     "configs": e.configs_sha256[:12], "state": state})
    return rows + [{"arch": "-", "op": "-", "variant": "-", "sha256": "-", "configs": "-",
                    "state": p} for p in lock.problems]


def _show_lock(reg: Registry, args: RegistryArgs, console: Console) -> int:
    _require_root(reg)
    rows = lock_rows(reg, args.lock_file)
    if args.as_json:
        console.print_json(json.dumps(rows))
    else:
        table = Table(title=f"lock {args.lock_file or reg.lock_path}")
        for col in ("arch", "op", "variant", "sha256", "configs", "state"):
            table.add_column(col, overflow="fold", no_wrap=col in ("arch", "op", "variant"))
        for r in rows:
            table.add_row(*(str(r[c]) for c in ("arch", "op", "variant", "sha256", "configs",
                                                  "state")))
        console.print(table if rows else f"the lock {args.lock_file or reg.lock_path} selects "
                      "nothing: every op runs the reference")
    return 1 if any(r["state"] != "ok" for r in rows) else 0


def _set_status(reg: Registry, args: RegistryArgs, console: Console) -> int:
    rec = writers.set_status(reg, args.op, args.variant, args.status, args.reason)
    console.print(f"{args.op}/{args.variant}: {rec.status}"
                  + (f" ({args.reason})" if args.reason else ""), highlight=False)
    return 0


def _accept(reg: Registry, args: RegistryArgs, console: Console) -> int:
    from .review import accept

    console.print(accept(reg, args.op, args.variant, args.arch), highlight=False)
    return 0


def _reject(reg: Registry, args: RegistryArgs, console: Console) -> int:
    from .review import reject

    console.print(reject(reg, args.op, args.variant, args.reason), highlight=False)
    return 0


def _migrate(reg: Registry, args: RegistryArgs, console: Console) -> int:
    from model.registry.migrate import migrate

    reg.prepare_write()
    done = migrate(reg.root)
    for line in done or [f"{reg.root}: already schema 2"]:
        console.print(line, highlight=False)
    return 0
