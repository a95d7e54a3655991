"""The optimize loop's way into the registry: register winners, tune existing variants.

A winner becomes a new immutable variant file with a candidate record
(`model.registry.writers.register`); its tuned configs are *proposed* in that record and reach
configs/ only when the variant is accepted (in review, or here with --auto-accept on a GPU). A
winner whose code is an existing variant's (the same program, whatever its comments and
docstrings say) won by its tuned meta-parameters only: they are proposed on that variant
(`writers.tune`) and no copy is registered. Reviewing (list, show, accept, reject) is the
`autoopt registry` / `autoopt review` command (autoopt/registry_cmd.py).
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from model.registry import ConfigTable, Registry, RegistryError, Verification, writers

from .loop_eval import RunContext, bucket, now_iso, slug


def variant_prefix(proposal: Any) -> str:
    agent = str(proposal.meta.get("agent") or "agent")
    if agent == "template":
        return f"template_{slug(str(proposal.meta.get('template') or proposal.name_hint))}"
    return f"{slug(agent)}_{slug(proposal.name_hint)}"


def next_name(reg: Registry, op: str, prefix: str) -> str:
    taken = set(reg.names(op)) if (reg.root / op).is_dir() else set()
    n = 1
    while f"{prefix}_v{n}" in taken:
        n += 1
    return f"{prefix}_v{n}"


def code_key(source: str) -> str | None:
    """The program a source defines, without comments and docstrings (None: not Python)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        scoped = ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
        if (isinstance(node, scoped) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree, include_attributes=False)


def same_code(reg: Registry, op: str, source: str, arch: str | None = None) -> str | None:
    """The registered variant whose program equals `source`'s: the one locked for `arch` first,
    then accepted, then candidate ones, never a rejected one; None when there is none."""
    key = code_key(source)
    if key is None or not (reg.root / op).is_dir():
        return None
    entry = reg.read_lock().section(arch or "").get(op)
    rank = {"accepted": 1, "candidate": 2}
    found = []
    for name in reg.variants(op):
        rec = reg.read_record(op, name)
        if rec is None or rec.status not in rank:
            continue
        _, data = reg.read_variant(op, name)
        if code_key(data.decode()) == key:
            found.append((0 if entry and name == entry.variant else rank[rec.status], name))
    return min(found)[1] if found else None


def slim_report(r: Mapping[str, Any]) -> dict:
    """What a record keeps of a judge's report."""
    keep = ("verdict", "reasons", "device", "seeds", "shapes", "config", "configs", "checks",
            "env", "elapsed_s", "sha256")
    return {k: r.get(k) for k in keep}


def timed_configs(rows: Sequence[Mapping]) -> dict[str, dict]:
    """{bucket: config} exactly as benchmarked: a bucket timed with the default config gets an
    explicit {} entry, so the runtime's nearest-bucket lookup cannot hand it another bucket's
    tuned config that was never timed there."""
    return {bucket(r["shape"]): dict(r.get("config") or {}) for r in rows}


def _proposed(op: str, gpu: str, rows: Sequence[Mapping]) -> ConfigTable:
    table = ConfigTable.from_rows(op, gpu, rows)
    return table if any(e.config for e in table.entries) else ConfigTable()


def _bench_rows(ctx: RunContext, rows: Sequence[Mapping]) -> list[dict]:
    return [{**r, "target": ctx.target.name, "proxy": ctx.proxy_note} for r in rows]


def register_variant(ctx: RunContext, task: Any, path: Path, proposal: Any, sha: str,
                     reports: Sequence[Mapping], rows: Sequence[Mapping],
                     speedup: float) -> str:
    """Copy a verified winner into the registry as a new variant; returns the outcome text."""
    reg, op = ctx.registry, task.op
    with ctx.lock:
        twin = same_code(reg, op, path.read_text(), ctx.arch)
        if twin is not None:
            return tune_existing(ctx, task, twin, proposal, reports, rows, speedup)
        for name in reg.variants(op):
            if reg.read_variant(op, name)[0].sha256 == sha:
                return f"same code as registered {op}/{name}; not registered again"
        name = next_name(reg, op, variant_prefix(proposal))
        accepted = ctx.auto_accept and ctx.meaningful
        meta = proposal.meta
        prov = writers.provenance(str(meta.get("agent", "unknown")), model=meta.get("model"),
                                  parent=task.current_name,
                                  prompt_sha256=meta.get("prompt_hash"), run=ctx.run_dir.name)
        checks = [Verification.from_report(ctx.arch, slim_report(r), sha, f"{op}/{name}.py")
                  for r in reports]
        optimize = {"run": ctx.run_dir.name, "speedup": speedup,
                    "baseline": task.current_name, "speed_judged": ctx.meaningful,
                    "profile_row": task.profile_row, "floor_us": task.floor_us,
                    "template": meta.get("template"), "notes": proposal.notes}
        why = ("verified on CPU: speed not judged" if not ctx.meaningful else
               "verified and faster; awaiting review")
        writers.register(reg, op, name, path.read_bytes(), prov, checks, _bench_rows(ctx, rows),
                         _proposed(op, ctx.gpu, rows), optimize, why)
        locked = ""
        if accepted:
            writers.accept(reg, op, name, ctx.arch,
                           reason="auto-accepted by autoopt optimize --auto-accept")
            locked = f" and locked for {ctx.arch}"
        append_notes(reg, op, name, proposal, speedup, ctx, task.current_name)
    return f"registered {op}/{name} as {'accepted' if accepted else 'candidate'}{locked}"


def tune_existing(ctx: RunContext, task: Any, name: str, proposal: Any,
                  reports: Sequence[Mapping], rows: Sequence[Mapping], speedup: float) -> str:
    """A winner with `name`'s code: propose its tuned configs on `name` (accepted and locked
    with --auto-accept on a GPU)."""
    reg, op = ctx.registry, task.op
    if not ctx.meaningful:
        return (f"same code as registered {op}/{name}; CPU timings cannot judge its configs, "
                "so nothing was written")
    table = _proposed(op, ctx.gpu, rows)
    if not table:
        return f"same code as registered {op}/{name} and no tuned config; not registered again"
    writers.tune(reg, op, name, table, {
        "run": ctx.run_dir.name, "gpu": ctx.gpu, "speedup": speedup,
        "baseline": task.current_name, "speed_judged": ctx.meaningful,
        "agent": proposal.meta.get("agent"), "template": proposal.meta.get("template"),
        "verification": [slim_report(r) for r in reports], "benchmarks": _bench_rows(ctx, rows)})
    locked, where = "", "proposed in its record until accepted"
    if ctx.auto_accept:
        try:
            writers.accept(reg, op, name, ctx.arch,
                           reason="auto-accepted with tuned configs by autoopt optimize")
            locked, where = f", accepted and locked for {ctx.arch}", "configs/"
        except RegistryError as exc:  # e.g. the variant was never verified on this arch
            locked = f"; not accepted: {exc}"
    per_bucket = timed_configs(rows)
    writers.note(reg, op, f"\n## {name}: tuned configs ({now_iso()}, agent "
                 f"{proposal.meta.get('agent')}, run {ctx.run_dir.name})\n\nSame program as "
                 f"{name}; only its meta-parameters were tuned, per token bucket: "
                 f"{json.dumps(per_bucket, sort_keys=True)}.\n\nResult: verified; "
                 f"{speedup:.3f}x over {task.current_name} on {ctx.gpu}.\n")
    # "registered <op>/<variant>": the run state counts it as this run's change to the set.
    return (f"registered {op}/{name} tuned configs (the same program: {where}{locked}; "
            "no new variant)")


def append_notes(reg: Registry, op: str, name: str, proposal: Any, speedup: float,
                 ctx: RunContext, baseline: str) -> None:
    hypothesis = proposal.notes.strip() or "(the agent gave no hypothesis)"
    if ctx.meaningful:
        result = (f"verified; {speedup:.3f}x over {baseline} "
                  f"(geometric mean over the bench shapes) on {ctx.gpu}")
    else:
        result = "verified on CPU (Triton interpreter); speed not judged (CPU timings)"
    writers.note(reg, op, f"\n## {name} ({now_iso()}, agent {proposal.meta.get('agent')}, run "
                 f"{ctx.run_dir.name})\n\n{hypothesis}\n\nResult: {result}. Target "
                 f"{ctx.target.name}{'; ' + ctx.proxy_note if ctx.proxy_note else ''}.\n")


def accept(reg: Registry, op: str, variant: str, arch: str | None = None) -> str:
    """Accept in review: configs move into configs/, locked for `arch` (default: where it
    passed verification)."""
    rec = writers.accept(reg, op, variant, arch)
    locked = [a for a, o, e in reg.read_lock().entries() if o == op and e.variant == variant]
    return (f"accepted {op}/{variant} and selected it for {', '.join(locked)} in "
            f"{reg.lock_path}" if locked else f"accepted {op}/{variant} ({rec.status_reason})")


def reject(reg: Registry, op: str, variant: str, why: str) -> str:
    """Reject with the reviewer's reason; unlocked wherever it was locked."""
    _, unlocked = writers.reject(reg, op, variant, why)
    tail = f"; removed from the lock for {', '.join(unlocked)}" if unlocked else ""
    return f"rejected {op}/{variant}: {why}{tail}"


__all__ = ["RegistryError", "accept", "append_notes", "code_key", "next_name",
           "register_variant", "reject", "same_code", "timed_configs", "tune_existing",
           "variant_prefix"]
