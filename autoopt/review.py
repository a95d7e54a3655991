"""Agent-produced variants in the registry: register winners, list, show, accept, reject.

Everything is plain files in the registry directory (variant sources, JSON records, tuned
configs, NOTES.md, the lock), so `git diff kernels/` shows exactly what `accept` or a run
changed. `register_variant` is the optimize loop's only way in: a new immutable file per
winner, never an edit of an existing one. A winner whose code is an existing variant's (the
same program, whatever its comments and docstrings say) won by its tuned meta-parameters only:
those go to that variant's configs/<variant>.json and its record, and no copy is registered.
"""

from __future__ import annotations

import ast
import difflib
import inspect
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from model.registry import Registry, RegistryError, current_arch, new_record

from .loop_eval import RunContext, bucket, now_iso, slug


# ---- registration (called by the loop) ------------------------------------------------------
def variant_prefix(proposal: Any) -> str:
    agent = str(proposal.meta.get("agent") or "agent")
    if agent == "template":
        return f"template_{slug(str(proposal.meta.get('template') or proposal.name_hint))}"
    return f"{slug(agent)}_{slug(proposal.name_hint)}"


def next_name(reg: Registry, op: str, prefix: str) -> str:
    taken = set(reg.variants(op))
    n = 1
    while f"{prefix}_v{n}" in taken or reg.record_path(op, f"{prefix}_v{n}").exists():
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
    if key is None:
        return None
    locked = reg.read_lock().get(arch or "", {}).get(op, {}).get("variant")
    rank = {"accepted": 1, "candidate": 2}
    found = []
    for name in reg.variants(op):
        status = (reg.read_record(op, name) or {}).get("status")
        if status in rank and code_key(reg.variant_path(op, name).read_text()) == key:
            found.append((0 if name == locked else rank[status], name))
    return min(found)[1] if found else None


def _slim_report(r: Mapping[str, Any]) -> dict:
    keep = ("verdict", "reasons", "device", "seeds", "shapes", "config", "checks", "env",
            "elapsed_s", "sha256")
    return {k: r.get(k) for k in keep}


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
            if reg.sha256(reg.variant_path(op, name)) == sha:
                return f"same code as registered {op}/{name}; not registered again"
        name = next_name(reg, op, variant_prefix(proposal))
        dst = reg.variant_path(op, name)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(path.read_bytes())
        per_bucket = timed_configs(rows)
        if any(per_bucket.values()):
            reg.write_configs(op, name, {ctx.gpu: per_bucket})
        accepted = ctx.auto_accept and ctx.meaningful
        status = "accepted" if accepted else "candidate"
        why = ("auto-accepted by autoopt optimize --auto-accept" if accepted else
               "verified on CPU: speed not judged" if not ctx.meaningful else
               "verified and faster; awaiting review")
        meta = proposal.meta
        rec = new_record(op, name, sha, agent=str(meta.get("agent", "unknown")),
                         model=meta.get("model"), parent=task.current_name,
                         prompt_sha256=meta.get("prompt_hash"), status=status, reason=why,
                         archs=[ctx.arch])
        rec["verification"] = {"device": reports[0].get("device") if reports else None,
                               "reports": [_slim_report(r) for r in reports]}
        rec["benchmarks"] = [{**r, "target": ctx.target.name, "proxy": ctx.proxy_note}
                             for r in rows]
        rec["optimize"] = {"run": ctx.run_dir.name, "speedup": speedup,
                           "baseline": task.current_name, "speed_judged": ctx.meaningful,
                           "profile_row": task.profile_row, "floor_us": task.floor_us,
                           "template": meta.get("template"), "notes": proposal.notes}
        reg.write_record(op, name, rec)
        locked = ""
        if accepted:
            reg.set_lock(ctx.arch, op, name)
            locked = f" and locked for {ctx.arch}"
        append_notes(reg, op, name, proposal, speedup, ctx, task.current_name)
    return f"registered {op}/{name} as {status}{locked}"


def timed_configs(rows: Sequence[Mapping]) -> dict[str, dict]:
    """{bucket: config} exactly as benchmarked: a bucket timed with the default config gets an
    explicit {} entry, so the runtime's nearest-bucket lookup cannot hand it another bucket's
    tuned config that was never timed there."""
    return {bucket(r["shape"]): dict(r.get("config") or {}) for r in rows}


def tune_existing(ctx: RunContext, task: Any, name: str, proposal: Any,
                  reports: Sequence[Mapping], rows: Sequence[Mapping], speedup: float) -> str:
    """A winner with `name`'s code: keep its tuned configs and evidence on `name` (caller locks)."""
    reg, op = ctx.registry, task.op
    if not ctx.meaningful:
        return (f"same code as registered {op}/{name}; CPU timings cannot judge its configs, "
                "so nothing was written")
    per_bucket = timed_configs(rows)
    if not any(per_bucket.values()):
        return f"same code as registered {op}/{name} and no tuned config; not registered again"
    configs = reg.read_configs(op, name)
    configs[ctx.gpu] = per_bucket
    reg.write_configs(op, name, configs)
    rec = reg.read_record(op, name) or {}
    rec.setdefault("tuned_configs", []).append({
        "run": ctx.run_dir.name, "gpu": ctx.gpu, "configs": per_bucket, "speedup": speedup,
        "baseline": task.current_name, "speed_judged": ctx.meaningful, "time": now_iso(),
        "agent": proposal.meta.get("agent"), "template": proposal.meta.get("template"),
        "verification": [_slim_report(r) for r in reports],
        "benchmarks": [{**r, "target": ctx.target.name, "proxy": ctx.proxy_note} for r in rows]})
    locked = ""
    if ctx.auto_accept and ctx.meaningful:
        if rec.get("status") != "accepted":
            rec["status"] = "accepted"
            rec["status_reason"] = "auto-accepted with tuned configs by autoopt optimize"
        reg.write_record(op, name, rec)
        reg.set_lock(ctx.arch, op, name)
        locked = f", accepted and locked for {ctx.arch}"
    else:
        reg.write_record(op, name, rec)
    _append_note(reg, op, f"\n## {name}: tuned configs ({now_iso()}, agent "
                 f"{proposal.meta.get('agent')}, run {ctx.run_dir.name})\n\nSame program as "
                 f"{name}; only its meta-parameters were tuned, per token bucket: "
                 f"{json.dumps(per_bucket, sort_keys=True)}.\n\nResult: verified; "
                 f"{speedup:.3f}x over {task.current_name} on {ctx.gpu}.\n")
    # "registered <op>/<variant>": the run state counts it as this run's change to the set.
    return (f"registered {op}/{name} tuned configs (the same program: configs/{name}.json"
            f"{locked}; no new variant)")


def append_notes(reg: Registry, op: str, name: str, proposal: Any, speedup: float,
                 ctx: RunContext, baseline: str) -> None:
    hypothesis = proposal.notes.strip() or "(the agent gave no hypothesis)"
    if ctx.meaningful:
        result = (f"verified; {speedup:.3f}x over {baseline} "
                  f"(geometric mean over the bench shapes) on {ctx.gpu}")
    else:
        result = "verified on CPU (Triton interpreter); speed not judged (CPU timings)"
    entry = (f"\n## {name} ({now_iso()}, agent {proposal.meta.get('agent')}, run "
             f"{ctx.run_dir.name})\n\n{hypothesis}\n\nResult: {result}. Target {ctx.target.name}"
             f"{'; ' + ctx.proxy_note if ctx.proxy_note else ''}.\n")
    _append_note(reg, op, entry)


def _append_note(reg: Registry, op: str, entry: str) -> None:
    notes = reg.root / op / "NOTES.md"
    if not notes.exists():
        notes.write_text(f"# {op}: notes per variant (hypothesis -> prediction -> result)\n")
    with notes.open("a") as f:
        f.write(entry)


# ---- review ---------------------------------------------------------------------------------
def geomean(values: Sequence[float]) -> float | None:
    vals = [v for v in values if v and v > 0]
    return math.exp(sum(map(math.log, vals)) / len(vals)) if vals else None


def record_summary(op: str, variant: str, rec: Mapping[str, Any]) -> dict:
    reports = rec.get("verification", {}).get("reports") or []
    verdict = ("pass" if reports and all(r.get("verdict") == "pass" for r in reports) else
               "reject" if reports else "unverified")
    opt = rec.get("optimize") or {}
    speed = opt.get("speedup")
    if speed is None:
        speed = geomean([b.get("x_reference") for b in rec.get("benchmarks", [])])
    return {"op": op, "variant": variant, "status": rec.get("status"),
            "agent": (rec.get("provenance") or {}).get("agent"), "speedup": speed,
            "speed_judged": opt.get("speed_judged", True), "verdict": verdict,
            "baseline": opt.get("baseline", "reference"), "run": opt.get("run")}


def pending(reg: Registry, status: str = "candidate") -> list[dict]:
    """Variants with `status` (pending review by default), newest run last."""
    out = []
    for op in reg.ops():
        for variant in reg.variants(op):
            rec = reg.read_record(op, variant)
            if rec and rec.get("status") == status:
                out.append(record_summary(op, variant, rec))
    return out


def _require(reg: Registry, op: str, variant: str) -> dict:
    rec = reg.read_record(op, variant)
    if rec is None:
        known = ", ".join(reg.variants(op)) if (reg.root / op).is_dir() else "none"
        raise RegistryError(f"no record for {op}/{variant} in {reg.root}; variants of {op}: "
                            f"{known} (autoopt review list shows pending ones)")
    return rec


def _arch_for(rec: Mapping, arch: str | None) -> str:
    return arch or (rec.get("archs") or [None])[0] or current_arch()


def selected_source(reg: Registry, op: str, arch: str) -> tuple[str, str]:
    """(label, source) of what the lock selects for (arch, op), else the reference module."""
    entry = reg.lock(arch).get(op)
    if entry is not None and reg.variant_path(op, entry.variant).is_file():
        return entry.variant, reg.variant_path(op, entry.variant).read_text()
    from model.ops import contract

    return "reference", inspect.getsource(contract(op).module)


def show_text(reg: Registry, op: str, variant: str, arch: str | None = None) -> str:
    """Source, diff, verification evidence, timings and profile delta as markdown text."""
    rec = _require(reg, op, variant)
    arch = _arch_for(rec, arch)
    src = reg.variant_path(op, variant).read_text()
    base_label, base_src = selected_source(reg, op, arch)
    diff = "".join(difflib.unified_diff(
        base_src.splitlines(keepends=True), src.splitlines(keepends=True),
        fromfile=f"{op}/{base_label} (selected for {arch})", tofile=f"{op}/{variant}"))
    s = record_summary(op, variant, rec)
    prov = rec.get("provenance") or {}
    lines = [f"# {op}/{variant}: {s['status']} ({rec.get('status_reason', '')})", "",
             f"agent {prov.get('agent')}, model {prov.get('model')}, parent "
             f"{prov.get('parent')}, prompt {prov.get('prompt_sha256')}, {prov.get('time')}, "
             f"git {prov.get('git_commit')}",
             f"sha256 {rec.get('sha256')}, archs {rec.get('archs')}", "", "## Source", "",
             "```python", src.rstrip(), "```", "", f"## Diff against {base_label}", "",
             "```diff", diff.rstrip() or "(identical)", "```", "", "## Verification", ""]
    lines += verification_lines(rec)
    lines += ["", "## Timings", ""] + timing_lines(rec)
    lines += ["", "## Profile delta", ""] + profile_delta_lines(rec)
    return "\n".join(lines) + "\n"


def verification_lines(rec: Mapping) -> list[str]:
    reports = (rec.get("verification") or {}).get("reports") or []
    if not reports:
        return ["no verification report recorded"]
    out = []
    for r in reports:
        out.append(f"- {r.get('verdict')} on {r.get('device')} with config {r.get('config')}: "
                   f"seeds {r.get('seeds')}, {len(r.get('shapes') or [])} shapes, "
                   f"{(r.get('elapsed_s') or 0):.1f} s" +
                   "".join(f"\n  - reason: {x}" for x in r.get("reasons") or []))
        checks = r.get("checks") or {}
        for k, v in checks.items():
            if isinstance(v, dict) and "passed" in v:
                out.append(f"  - {k}: {'passed' if v['passed'] else 'FAILED'}")
        for o in (checks.get("numerics") or {}).get("outputs", []):
            out.append(f"  - output {o.get('dtype')}: policy {o.get('policy')}, "
                       f"{json.dumps({k: o[k] for k in o if 'mismatch' in k or k == 'max_ulp'})}")
        for name, d in ((checks.get("near_misses") or {}).get("by_name") or {}).items():
            out.append(f"  - near miss {name}: {d.get('status')}")
    return out


def timing_lines(rec: Mapping) -> list[str]:
    rows = rec.get("benchmarks") or []
    if not rows:
        return ["no benchmarks recorded"]
    out = ["| shape | median us | IQR us | x reference | x torch.compile | % of floor | config |"
           " device |", "|---|---|---|---|---|---|---|---|"]
    for b in rows:
        xc = b.get("x_compile")
        out.append(f"| {b.get('shape')} | {b.get('median_us', 0):.2f} | {b.get('iqr_us', 0):.2f}"
                   f" | {b.get('x_reference', 0):.3f} | {f'{xc:.3f}' if xc else '-'} | "
                   f"{b.get('pct_of_floor', 0):.1f} | {b.get('config')} | "
                   f"{b.get('gpu') or b.get('device')} |")
    if not all(b.get("meaningful", True) for b in rows):
        out.append("\nCPU timings: not meaningful for speed (correctness only).")
    return out


def profile_delta_lines(rec: Mapping) -> list[str]:
    opt = rec.get("optimize") or {}
    row, speed = opt.get("profile_row") or {}, opt.get("speedup")
    if not row:
        return ["no profile row recorded (not produced by autoopt optimize)"]
    t = row.get("time_us")
    est = t / speed if t and speed and opt.get("speed_judged") else None
    out = [f"before: {t} us per step over {row.get('calls')} calls, share {row.get('share')}%, "
           f"floor {row.get('floor_us')} us, gap {row.get('gap_us')} us"]
    out.append(f"after (estimated from the op speedup {speed:.3f}x): {est:.2f} us" if est else
               "after: not estimated (speed not judged on this device)")
    return out


def _review_entry(rec: dict, action: str, **data: Any) -> None:
    rec.setdefault("review", []).append({"time": now_iso(), "action": action, **data})


def accept(reg: Registry, op: str, variant: str, arch: str | None = None) -> str:
    """Mark the variant accepted and select it in the lock for `arch`."""
    rec = _require(reg, op, variant)
    arch = _arch_for(rec, arch)
    archs = rec.get("archs") or []
    if archs and arch not in archs:
        raise RegistryError(f"{op}/{variant} was verified for {archs}, not {arch}; verify it on "
                            f"{arch} (autoopt verify) before accepting it there")
    rec["status"], rec["status_reason"] = "accepted", f"accepted in review for {arch}"
    _review_entry(rec, "accept", arch=arch)
    reg.write_record(op, variant, rec)
    reg.set_lock(arch, op, variant)
    return f"accepted {op}/{variant} and selected it for {arch} in {reg.lock_path}"


def reject(reg: Registry, op: str, variant: str, why: str) -> str:
    """Mark the variant rejected with the reviewer's reason; unlock it wherever it is locked."""
    if not why.strip():
        raise RegistryError("reject needs a reason: --why 'what is wrong with it'")
    rec = _require(reg, op, variant)
    rec["status"], rec["status_reason"] = "rejected", why
    _review_entry(rec, "reject", why=why)
    reg.write_record(op, variant, rec)
    unlocked = [a for a, ops in reg.read_lock().items()
                if (ops.get(op) or {}).get("variant") == variant and reg.unset_lock(a, op)]
    tail = f"; removed from the lock for {', '.join(unlocked)}" if unlocked else ""
    return f"rejected {op}/{variant}: {why}{tail}"


# ---- command output (the CLI's `autoopt review ...`) ----------------------------------------
def print_list(reg: Registry, console: Any, status: str = "candidate") -> int:
    from rich.table import Table

    rows = pending(reg, status)
    table = Table(title=f"{status} variants in {reg.root}")
    for col in ("op", "variant", "agent", "speedup", "verdict", "baseline"):
        # Names are what a reviewer types next: never cut them.
        table.add_column(col, justify="right" if col == "speedup" else "left",
                         no_wrap=col in ("op", "variant"), min_width=len(col))
    for r in rows:
        speed = (f"{r['speedup']:.3g}x" if r["speedup"] else "-") + (
            "" if r["speed_judged"] else " (cpu: not judged)")
        table.add_row(r["op"], r["variant"], str(r["agent"]), speed, r["verdict"],
                      str(r["baseline"]))
    console.print(table if rows else f"no {status} variants in {reg.root}")
    return 0


def print_show(reg: Registry, console: Any, op: str, variant: str, arch: str | None) -> int:
    from rich.markdown import Markdown

    text = show_text(reg, op, variant, arch)
    console.print(Markdown(text) if console.is_terminal else text)
    return 0
