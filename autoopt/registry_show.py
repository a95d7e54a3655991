"""One variant as a reviewer reads it: source, diff against what it would replace, evidence.

`show_text` renders markdown (the terminal pretty-prints it; a pipe gets the text): provenance,
the file's state, where it is locked, the source, a diff against the variant locked for the arch
(or the op's reference), verification per arch, timings, tuned and proposed configs, and the
profile row the optimize loop saw. Everything is read through `model.registry`.
"""

from __future__ import annotations

import difflib
import inspect
import json
from collections.abc import Mapping

from model.registry import Record, Registry, RegistryError, sha256_bytes


def file_state(reg: Registry, op: str, name: str, rec: Record | None) -> str:
    """ok | MODIFIED | missing | unsafe (a symlink or outside the root) | unrecorded."""
    path = reg.variant_path(op, name)
    if not path.exists() and not path.is_symlink():
        return "missing"
    try:
        data = reg.safe_bytes(path)
    except RegistryError:
        return "unsafe"
    if rec is None:
        return "unrecorded"
    return "ok" if sha256_bytes(data) == rec.variant.sha256 else "MODIFIED"


def locked_in(reg: Registry, op: str, name: str) -> list[str]:
    return [a for a, o, e in reg.read_lock().entries() if o == op and e.variant == name]


def selected_source(reg: Registry, op: str, arch: str, skip: str | None = None
                    ) -> tuple[str, str]:
    """(label, source) of what the lock selects for (arch, op), else the reference module;
    `skip`: a variant that replaces nothing when it is the selection itself (diff it against
    the reference instead)."""
    entry = reg.read_lock().section(arch).get(op)
    if entry is not None and entry.variant != skip:
        try:
            return entry.variant, reg.read_variant(op, entry.variant)[1].decode()
        except RegistryError:
            pass
    from model.ops import contract

    return "reference", inspect.getsource(contract(op).module)


def show_text(reg: Registry, op: str, name: str, arch: str | None = None) -> str:
    rec = reg.read_record(op, name)
    if rec is None:
        known = ", ".join(reg.names(op)) if (reg.root / op).is_dir() else "none"
        raise RegistryError(f"no record for {op}/{name} in {reg.root}; variants of {op}: "
                            f"{known} (autoopt registry list shows them all)")
    arch = arch or next((a for a, v in rec.verdicts().items() if v == "pass"), "cpu")
    state = file_state(reg, op, name, rec)
    src = reg.read_variant(op, name)[1].decode() if state in ("ok", "MODIFIED") else ""
    base_label, base_src = selected_source(reg, op, arch)
    diff = "".join(difflib.unified_diff(
        base_src.splitlines(keepends=True), src.splitlines(keepends=True),
        fromfile=f"{op}/{base_label} (selected for {arch})", tofile=f"{op}/{name}"))
    p, v = rec.provenance, rec.variant
    locked = ", ".join(locked_in(reg, op, name)) or "-"
    lines = [f"# {op}/{name}: {rec.status} ({rec.status_reason})", "",
             f"agent {p.agent}, model {p.model}, parent {p.parent}, prompt {p.prompt_sha256}, "
             f"{p.time}, git {p.git_commit}, run {p.run}",
             f"file {state}; sha256 {v.sha256}; language {v.language}"
             + (f" ({v.library})" if v.library else "") + f"; archs {v.archs or 'any'}; "
             f"runs on cpu: {v.runs_on_cpu}; locked for {locked}",
             "", "## Source", "", "```python", src.rstrip() or f"({state})", "```", "",
             f"## Diff against {base_label}", "", "```diff", diff.rstrip() or "(identical)",
             "```", "", "## Verification", "", *verification_lines(rec), "", "## Timings", "",
             *timing_lines(rec), "", "## Tuned configs", "", *config_lines(reg, rec), "",
             "## Profile delta", "", *profile_delta_lines(rec)]
    return "\n".join(lines) + "\n"


def verification_lines(rec: Record) -> list[str]:
    if not rec.verification:
        return ["no verification recorded"]
    out = []
    for arch, entries in rec.verification.items():
        out.append(f"verified on {arch}: {rec.verdict(arch)}")
        for v in entries:
            r = v.report
            mine = "" if v.sha256 == rec.variant.sha256 else f" (of another file {v.sha256[:12]})"
            per = r.get("configs")
            how = (f"with a config per bucket {dict(per)}" if per else
                   f"with config {dict(v.config or {})}")
            out.append(f"- {v.verdict} on {v.device} {how}{mine}: "
                       f"seeds {list(r.get('seeds') or [])}, {len(r.get('shapes') or [])} shapes"
                       f", {(r.get('elapsed_s') or 0):.1f} s"
                       + "".join(f"\n  - reason: {x}" for x in v.reasons))
            checks = r.get("checks") or {}
            for k, c in checks.items():
                if isinstance(c, Mapping) and "passed" in c:
                    out.append(f"  - {k}: {'passed' if c['passed'] else 'FAILED'}")
            for o in (checks.get("numerics") or {}).get("outputs", []):
                nums = {k: o[k] for k in o if "mismatch" in k or k == "max_ulp"}
                out.append(f"  - output {o.get('dtype')}: policy {o.get('policy')}, "
                           f"{json.dumps(nums)}")
            for n, d in ((checks.get("near_misses") or {}).get("by_name") or {}).items():
                out.append(f"  - near miss {n}: {d.get('status')}")
    return out


def timing_lines(rec: Record) -> list[str]:
    if not rec.benchmarks:
        return ["no benchmarks recorded"]
    out = ["| target | gpu | shape | median us | IQR us | x reference | x torch.compile | "
           "% of floor | config |", "|---|---|---|---|---|---|---|---|---|"]
    for b in rec.benchmarks:
        xc = b.get("x_compile")
        out.append(f"| {b.get('target', '-')} | {b.gpu} | {dict(b.shape)} | "
                   f"{b.get('median_us') or 0:.2f} | {b.get('iqr_us') or 0:.2f} | "
                   f"{b.get('x_reference') or 0:.3f} | {f'{xc:.3f}' if xc else '-'} | "
                   f"{b.get('pct_of_floor') or 0:.1f} | {dict(b.get('config') or {})} |")
    if not all(b.meaningful for b in rec.benchmarks):
        out.append("\nCPU timings: not meaningful for speed (correctness only).")
    return out


def config_lines(reg: Registry, rec: Record) -> list[str]:
    out = []
    for label, table in (("accepted (configs/)", reg.read_configs(rec.op, rec.name)),
                         ("proposed (written to configs/ on accept)", rec.proposed_configs)):
        for e in table.entries:
            out.append(f"- {label}: {e.key}: {json.dumps(dict(e.config), sort_keys=True)}")
    return out or ["none (the variant's DEFAULT_CONFIG everywhere)"]


def profile_delta_lines(rec: Record) -> list[str]:
    opt = rec.optimize or {}
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
