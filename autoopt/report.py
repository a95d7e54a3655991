"""The optimize run's end-to-end check and its report (`report.md` + PNG plots in the run dir).

End-to-end: one step of the target's workload (same weights, same inputs) with the reference
set and with the new set (this arch's lock plus this run's winners, written to
`e2e.lock.toml`): logits compared (bitwise-equal fraction, max |diff|, top-1 agreement) and
step times (median; CUDA graphs where the runtime would use them; CPU times not meaningful).
Parity passes when every sequence's top-1 token agrees and max |diff| <= E2E_MAX_ABS: kernels
within their op policies (bitwise or 1 BF16 ulp at a few elements) move softcapped logits far
less than that, a wrong kernel moves them far more.

The report also shows `autoopt profile --compare profile_reference.json profile_after.json`:
the reference set against the tuned set after the run, per op and for the whole step.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console

E2E_MAX_ABS = 0.25  # logits are softcapped to +-30; an ulp-level kernel change moves them ~1e-2


def _new_lock(ctx: Any, state: Any) -> Path | None:
    winners = state.winners()
    if not winners:
        return None
    from model.registry import Lock, writers

    reg = ctx.registry
    section = dict(reg.read_lock().section(ctx.arch))
    for op, w in winners.items():  # verified candidates of this run, pinned as the runtime checks
        section[op] = writers.lock_entry(reg, op, w["variant"], ctx.arch, allow_candidates=True)
    path = ctx.run_dir / "e2e.lock.toml"
    path.write_text(Lock({ctx.arch: section}).to_toml())
    return path


def end_to_end(ctx: Any, state: Any, batch: int | None, layers: int | None,
               console: Console) -> dict:
    """Reference set vs new set on one step: output parity and time."""
    import torch

    from model.registry import resolve_ops

    from .profiler import time_step
    from .profiler.workload import build_workload, free_workload

    lock = _new_lock(ctx, state)
    if lock is None:
        return {"ran": False, "why": "no variant was registered in this run"}
    device = "cpu" if not ctx.meaningful else "cuda"
    table = resolve_ops(kernels=lock, registry=ctx.registry.root, arch=ctx.arch, device=device,
                        allow_candidates=True)
    refused = {op: r.refused for op, r in table.resolution.items() if r.refused}
    batch = batch or ctx.target.batch_sizes[0]
    with console.status("end-to-end check: reference set vs new set"):
        work = build_workload(ctx.target, batch, layers, None, "reference", device, seed=0)
        try:
            ref = work.step().float().clone()
            ref_us, ref_graph = time_step(work, 3 if ctx.meaningful else 1)
            work.model.set_ops(table)
            if hasattr(work.model.attention_backend, "ops"):
                work.model.attention_backend.ops = table
            work.graph = None
            new = work.step().float().clone()
            new_us, new_graph = time_step(work, 3 if ctx.meaningful else 1)
        finally:
            free_workload(work)
    diff = (new - ref).abs()
    top1 = (new.argmax(-1) == ref.argmax(-1)).all().item()
    out = {"ran": True, "lock": str(lock), "batch": batch, "device": device,
           "sources": {op: s for op, s in table.sources.items() if s != "reference"},
           "refused": refused, "bitwise_equal_fraction": float((new == ref).float().mean()),
           "max_abs_diff": float(diff.max()), "top1_agree": bool(top1),
           "max_abs_bound": E2E_MAX_ABS,
           "reference_step_us": ref_graph or ref_us, "new_step_us": new_graph or new_us,
           "graphs": bool(ref_graph and new_graph), "meaningful": ctx.meaningful}
    out["parity"] = bool(top1 and out["max_abs_diff"] <= E2E_MAX_ABS and not refused
                         and torch.isfinite(new).all().item())
    out["speedup"] = out["reference_step_us"] / max(out["new_step_us"], 1e-9)
    # Profiled on the CPU too: the report's reference-vs-tuned table needs it (CPU times only
    # inform there, and the report says so).
    out["profile_after"] = _profile_after(ctx, state, batch, layers, lock)
    return out


def _profile_after(ctx: Any, state: Any, batch: int, layers: int | None, lock: Path) -> str:
    from .profiler import profile_step
    from .profiler.report import write_outputs

    backend = (state.data.get("args") or {}).get("profile_backend", "auto")
    prof = profile_step(ctx.target, batch=batch, layers=layers, kernels=str(lock),
                        proxy=bool(ctx.proxy_note), backend=backend,
                        registry=ctx.registry.root)
    json_path, _ = write_outputs(prof, ctx.run_dir, "profile_after")
    return str(json_path)


# ---- the report ---------------------------------------------------------------------------
def _fmt(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def _attempt_rows(state: Any) -> list[dict]:
    return [{**a.to_dict(), "proposal": p} for a, p in state.attempts()]


def write_plots(state: Any, out: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401 - MaxNLocator below

    ops = [o for o in state.data["ops"] if o["status"] != "skipped"]
    rows = _attempt_rows(state)
    after = _after_times(state)
    paths = {}
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(ops) + 2))
    y = range(len(ops))
    ax.barh([i + 0.2 for i in y], [o["time_us"] for o in ops], height=0.4, label="before")
    ax.barh([i - 0.2 for i in y], [after.get(o["op"], o["time_us"]) for o in ops], height=0.4,
            label=_after_label(state))
    ax.set_yticks(list(y), [o["op"] for o in ops])
    ax.set_xlabel("µs per step" + ("" if _meaningful(state) else " (CPU: not meaningful)"))
    ax.legend()
    paths["time_per_op"] = _save(fig, plt, out / "time_per_op.png")
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(ops) + 2))
    best = [max([r["speedup"] or 0 for r in rows if r["op"] == o["op"] and
                 r["verdict"] == "pass"] or [0]) for o in ops]
    ax.barh(list(y), best, color="tab:green")
    ax.axvline(1.0, color="k", lw=1)
    ax.set_yticks(list(y), [o["op"] for o in ops])
    ax.set_xlabel("best verified speedup over the baseline" +
                  ("" if _meaningful(state) else " (CPU: not meaningful)"))
    paths["speedup_per_op"] = _save(fig, plt, out / "speedup_per_op.png")
    fig, ax = plt.subplots(figsize=(8, 4))
    for k, o in enumerate(ops):
        mine = [r for r in rows if r["op"] == o["op"]]
        ax.scatter([r["index"] for r in mine], [r["speedup"] or 0 for r in mine],
                   marker="o", label=o["op"], color=f"C{k % 10}")
        bad = [r for r in mine if r["verdict"] != "pass"]
        ax.scatter([r["index"] for r in bad], [0] * len(bad), marker="x", color=f"C{k % 10}")
    ax.set_xlabel("attempt")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_ylabel("speedup (x = rejected)")
    if ops:
        ax.legend(fontsize=7)
    paths["candidate_history"] = _save(fig, plt, out / "candidate_history.png")
    return paths


def _after_label(state: Any) -> str:
    if (state.data.get("e2e") or {}).get("profile_after"):
        return "after (profiled)"
    if not _meaningful(state):
        return "after (CPU: speed not judged, shown unchanged)"
    return "after (estimated: before / op speedup)"


def _save(fig: Any, plt: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _meaningful(state: Any) -> bool:
    return bool((state.data.get("profile") or {}).get("meaningful"))


def _after_times(state: Any) -> dict[str, float]:
    after_path = (state.data.get("e2e") or {}).get("profile_after")
    if after_path and Path(after_path).is_file():
        rows = json.loads(Path(after_path).read_text())["rows"]
        return {r["op"]: r["time_us"] for r in rows}
    out = {}
    for op, w in state.winners().items():
        before = state.op(op)["time_us"]
        if w.get("speedup") and _meaningful(state):
            out[op] = before / w["speedup"]
    return out


def write_report(state: Any, ctx: Any) -> Path:
    """`report.md` in the run directory, with the plots next to it."""
    d, out = state.data, state.run_dir
    plots = write_plots(state, out / "plots")
    prof = d.get("profile") or {}
    cpu = not ctx.meaningful
    lines = [f"# autoopt optimize: {d['target']}", "",
             f"Run {out.name}; agent {d['args'].get('agent')}; created {d['created']}; phase "
             f"{d['phase']}. Device: {prof.get('gpu')}" + (f"; {ctx.proxy_note}" if
                                                          ctx.proxy_note else "") + ".",
             f"Profile: {prof.get('kernels')} kernels, batch {prof.get('batch')}, "
             f"{prof.get('layers')} layers, backend {prof.get('backend')}, step "
             f"{_fmt(prof.get('step_us'))} µs.", ""]
    if cpu:
        lines += ["**CPU run: speed was not judged.** Timings on the CPU (Triton interpreter) say "
                  "nothing about GPU speed; every verified candidate was registered as "
                  "`candidate` (never accepted or locked), so a person or a GPU run decides.", ""]
    else:
        lines += ["A verified candidate wins when its speedup over the current selection "
                  "(geometric mean over the bench shapes) exceeds 1 + max(2%, the timing noise);"
                  f" winners are {'accepted and locked' if ctx.auto_accept else 'candidates'}.",
                  ""]
    lines += ["## Ops by gap to the floor", "", "| op | status | time µs | floor µs | gap µs | "
              "baseline | attempts | registered | stop |", "|---|---|---|---|---|---|---|---|---|"]
    for o in d["ops"]:
        regs = ", ".join(r["variant"] for r in o.get("registered") or []) or "-"
        lines.append(f"| {o['op']} | {o['status']} | {_fmt(o.get('time_us'))} | "
                     f"{_fmt(o.get('floor_us'))} | {_fmt(o.get('gap_us'))} | "
                     f"{o.get('baseline', '-')} | {o.get('attempts', 0)} | {regs} | "
                     f"{o.get('stop_reason') or o.get('note') or '-'} |")
    lines += ["", "## Attempts", "", "| op | # | candidate | verdict | speedup | outcome | "
              "first reason |", "|---|---|---|---|---|---|---|"]
    for r in _attempt_rows(state):
        reason = (r["reasons"] or [""])[0].replace("|", "/")[:140]
        lines.append(f"| {r['op']} | {r['index']} | {r['candidate']} | {r['verdict']} | "
                     f"{_fmt(r['speedup'], '.3g')} | {r['outcome']} | {reason} |")
    lines += ["", "## End-to-end check", ""] + _e2e_lines(d.get("e2e"), cpu)
    lines += _compare_lines(out / "profile_before.json", (d.get("e2e") or {}).get("profile_after"))
    ref_lines, ref_plot = reference_section(state)
    lines += ref_lines
    if ref_plot is not None:
        plots["reference_vs_tuned"] = ref_plot
    lines += ["", "## Plots", ""] + [f"![{k}](plots/{p.name})" for k, p in plots.items()]
    reg = ctx.registry.root
    lines += ["", "## Review", "", f"`autoopt review list --registry {reg}` lists what waits for "
              "review; `autoopt review show OP VARIANT` shows source, diff, evidence and "
              "timings; `git diff` of the registry shows every file this run wrote."]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _e2e_lines(e: dict | None, cpu: bool) -> list[str]:
    if not e:
        return ["not run"]
    if not e.get("ran"):
        return [f"not run: {e.get('why')}"]
    speed = e["speedup"]
    out = [f"New set ({', '.join(f'{k}: {v}' for k, v in e['sources'].items())}) vs the "
           f"reference set, batch {e['batch']} on {e['device']}:", "",
           f"- parity: {'PASS' if e['parity'] else 'FAIL'}; top-1 agree {e['top1_agree']}, max "
           f"|diff| {e['max_abs_diff']:.3g} (bound {e['max_abs_bound']}), bitwise-equal logits "
           f"{100 * e['bitwise_equal_fraction']:.2f}%",
           f"- step time: reference {e['reference_step_us']:.1f} µs, new {e['new_step_us']:.1f} µs"
           f" ({speed:.3f}x{', CUDA graphs' if e.get('graphs') else ''})"
           + (" — CPU: not meaningful" if cpu else "")]
    if e.get("refused"):
        out.append(f"- refused at load: {e['refused']}")
    if e.get("profile_after"):
        out.append(f"- profile after: {e['profile_after']} (compare: autoopt profile --compare "
                   f"profile_before.json profile_after.json)")
    if not math.isfinite(speed):
        out.append("- speedup undefined")
    return out


def _compare_lines(before: Path, after: str | None) -> list[str]:
    """`autoopt profile --compare before after` as a markdown table."""
    if not after or not before.is_file() or not Path(after).is_file():
        return []
    a, b = (json.loads(Path(p).read_text()) for p in (before, after))
    rows_b = {r["op"]: r for r in b["rows"]}
    out = ["", f"## Profile: before ({a['kernels']} kernels) vs after (this run's set)", "",
           f"{a['gpu']}, batch {a['batch']}, {a['layers']} layers, backend {a['backend']}.", "",
           "| op | before µs | after µs | speedup | floor µs |", "|---|---|---|---|---|"]
    for r in a["rows"]:
        rb = rows_b.get(r["op"])
        t_b = rb["time_us"] if rb else None
        speed = f"{r['time_us'] / t_b:.2f}x" if t_b else "-"
        out.append(f"| {r['op']} | {r['time_us']:.1f} | {_fmt(t_b, '.1f')} | {speed} | "
                   f"{_fmt(r.get('floor_us'), '.2f')} |")
    step = a["step_us"] / b["step_us"] if b.get("step_us") else None
    out.append(f"| **step** | {a['step_us']:.1f} | {b['step_us']:.1f} | {_fmt(step, '.2f')}x | "
               f"{_fmt(a.get('floor_us'), '.1f')} |")
    if a.get("graph_step_us") and b.get("graph_step_us"):
        out.append(f"\nCUDA-graph step: {a['graph_step_us']:.1f} µs -> {b['graph_step_us']:.1f} µs"
                   f" ({a['graph_step_us'] / b['graph_step_us']:.2f}x).")
    return out


def _tuned_after(state: Any) -> Path | None:
    """The tuned set's profile after the run: this run's set where one was profiled, else the
    before profile (nothing registered: the tuned set did not change)."""
    after = (state.data.get("e2e") or {}).get("profile_after")
    if after and Path(after).is_file():
        return Path(after)
    before = state.run_dir / "profile_before.json"
    winners = state.winners()
    if not winners and (state.data.get("profile") or {}).get("kernels") == "tuned":
        return before if before.is_file() else None
    return None


def reference_section(state: Any) -> tuple[list[str], Path | None]:
    """`autoopt profile --compare profile_reference.json <tuned after>` as markdown + a plot."""
    from .profiler.attribution import Profile
    from .profiler.report import (
        compare_markdown,
        compare_warnings,
        step_speedup,
        write_compare_chart,
    )

    ref_name = state.data.get("profile_reference")
    ref = state.run_dir / ref_name if ref_name else None
    tuned = _tuned_after(state)
    head = ("## Reference vs tuned (autoopt profile --compare profile_reference.json "
            f"{tuned.name if tuned else 'profile_after.json'})")
    if ref is None or not ref.is_file() or tuned is None:
        why = ("no reference profile" if ref is None or not ref.is_file() else
               "the tuned set after the run was not profiled (end-to-end check not run)")
        return ["", head, "", f"not available: {why}"], None
    a, b = Profile.load(ref), Profile.load(tuned)
    names = ("reference", "tuned")
    speed = step_speedup(a, b)
    lines = ["", head, "", f"{b.gpu}, batch {b.batch}, {b.layers} layers, backend {b.backend}; "
             f"tuned = {_tuned_label(tuned)}.", ""] + compare_markdown(a, b, names)
    lines += ["", f"Whole step: reference {a.step_us:.1f} µs, tuned {b.step_us:.1f} µs "
              f"({'-' if speed is None else f'{speed:.2f}'}x)"
              + ("" if b.rates.meaningful else " — CPU: not meaningful") + "."]
    if a.graph_step_us and b.graph_step_us:
        lines.append(f"CUDA-graph step: reference {a.graph_step_us:.1f} µs, tuned "
                     f"{b.graph_step_us:.1f} µs ({a.graph_step_us / b.graph_step_us:.2f}x).")
    lines += [f"warning: {w}" for w in compare_warnings(a, b)]
    plot = write_compare_chart(a, b, state.run_dir / "plots" / "reference_vs_tuned.png", names)
    return lines, plot


def _tuned_label(path: Path) -> str:
    if path.name == "profile_before.json":
        return "the lock profiled before the run (nothing was registered)"
    return "the lock plus this run's winners (e2e.lock.toml)"
