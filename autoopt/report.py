"""The optimize run's end-to-end check and its report (`report.md` + PNG plots in the run dir).

End-to-end: `autoopt bench model` in this process (bench_model.py) at the batch sizes the plan
kept, each at the first of the target's contexts where it fits: the served step with the
reference set (on a GPU `reference-graphs`, the reference with a capturable MoE, replayed as a
server replays it), the tuned set (this arch's lock) and the run's new set (the lock plus this
run's winners, written to `e2e.lock.toml`): ms per step (CUDA graphs where the runtime uses
them; CPU times not meaningful) against the step's floor, and the parity
of each set's logits with the reference set's on the same sequences. Parity passes when every
sequence's top-1 token agrees and max |diff| <= E2E_MAX_ABS: kernels within their op policies
(bitwise or 1 BF16 ulp at a few elements) move softcapped logits far less than that, a wrong
kernel moves them far more. The report's headline is that table: ms per step against the floor,
per batch size.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

E2E_MAX_ABS = 0.25  # logits are softcapped to +-30; an ulp-level kernel change moves them ~1e-2
NEW_SET = "e2e.lock.toml"


def _new_lock(ctx: Any, state: Any) -> Path | None:
    winners = state.winners()
    if not winners:
        return None
    from model.registry import Lock, writers

    reg = ctx.registry
    section = dict(reg.read_lock().section(ctx.arch))
    for op, w in winners.items():  # verified candidates of this run, pinned as the runtime checks
        section[op] = writers.lock_entry(reg, op, w["variant"], ctx.arch, allow_candidates=True)
    path = ctx.run_dir / NEW_SET
    path.write_text(Lock({ctx.arch: section}).to_toml())
    return path


def end_to_end(ctx: Any, state: Any, batches: tuple[int, ...], layers: int | None,
               deadline: float, clock: Any) -> dict:
    """`bench model`: reference vs tuned vs the run's set at `batches`, within `deadline`."""
    from .bench_model import BenchModelArgs, kernel_label, run_bench
    from .bench_model_report import headline, write_outputs
    from .runlog import say

    lock = _new_lock(ctx, state)
    # On a GPU the baseline is the reference as a server replays it (CUDA graphs: the MoE on its
    # capturable library path); the plain reference's MoE syncs with the host, so it runs
    # eagerly, which no server does. Each batch runs at the target's first context where it
    # fits beside the model (a TP rank's long context leaves no room for its largest batches).
    base = "reference-graphs" if ctx.meaningful else "reference"
    sets = (base, "tuned") + ((str(lock),) if lock else ()) + (
        ("compile",) if ctx.compile and ctx.meaningful else ())  # the peer, with --compile
    args = BenchModelArgs(
        target=str(ctx.target.source or ctx.target.name), batches=tuple(batches),
        contexts=tuple(ctx.target.contexts), first_fit=True, layers=layers, kernels=sets,
        registry=str(ctx.registry.root), iters=None if ctx.meaningful else 1,
        warmup=1 if ctx.meaningful else 0, proxy=bool(ctx.proxy_note),
        budget_s=max(1.0, deadline - clock()), count_kernels=ctx.meaningful)
    res = run_bench(args, say=say)
    paths = write_outputs(res, ctx.run_dir / "e2e")
    for line in headline(res):
        say(line)
    new = kernel_label(str(lock)) if lock else None
    rows = [r for r in res.rows if r.ran and r.kernels == new]
    parity = bool(rows) and all(
        r.parity and r.parity["top1_agree"] and r.parity["finite"]
        and r.parity["max_abs_diff"] <= E2E_MAX_ABS for r in rows)
    return {"ran": True, "json": str(paths["json"]), "md": str(paths["md"]),
            "png": str(paths["png"]), "lock": str(lock) if lock else None, "new_set": new,
            "kernels": res.kernels, "meaningful": res.meaningful, "parity": parity if new
            else None, "max_abs_bound": E2E_MAX_ABS,
            "sources": _sources(ctx, lock), "skipped": [f"{r.context}/{r.batch} {r.kernels}: "
                                                        f"{r.why}" for r in res.rows
                                                        if not r.ran]}


def _sources(ctx: Any, lock: Path | None) -> dict[str, str]:
    """Ops the new set takes from the registry (what the check ran)."""
    if lock is None:
        return {}
    return {op: e.variant for op, e in ctx.registry.read_lock(lock).section(ctx.arch).items()}


# ---- the report ---------------------------------------------------------------------------
def _fmt(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def _attempt_rows(state: Any) -> list[dict]:
    return [{**a.to_dict(), "proposal": p} for a, p in state.attempts()]


def _meaningful(state: Any) -> bool:
    return bool((state.data.get("profile") or {}).get("meaningful"))


def _save(fig: Any, plt: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _after_times(state: Any) -> dict[str, float]:
    """Per op, the time after the run estimated from its winner's speedup (GPU only)."""
    out = {}
    for op, w in state.winners().items():
        before = state.op(op)["time_us"]
        if w.get("speedup") and _meaningful(state):
            out[op] = before / w["speedup"]
    return out


def write_plots(state: Any, out: Path) -> dict[str, Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401 - MaxNLocator below

    ops = [o for o in state.data["ops"] if o["status"] != "skipped"]
    rows = _attempt_rows(state)
    after = _after_times(state)
    cpu = "" if _meaningful(state) else " (CPU: not meaningful)"
    paths = {}
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(ops) + 2))
    y = range(len(ops))
    ax.barh([i + 0.2 for i in y], [o["time_us"] for o in ops], height=0.4, label="before")
    ax.barh([i - 0.2 for i in y], [o.get("floor_us") or 0 for o in ops], height=0.4,
            label="floor", color="tab:green")
    if after:
        ax.scatter([after.get(o["op"], o["time_us"]) for o in ops], list(y), marker="|", s=200,
                   color="k", label="after (before / op speedup)")
    ax.set_yticks(list(y), [o["op"] for o in ops])
    ax.set_xlabel("µs per step, summed over the profiled batch sizes" + cpu)
    ax.legend()
    paths["time_per_op"] = _save(fig, plt, out / "time_per_op.png")
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(ops) + 2))
    best = [max([r["speedup"] or 0 for r in rows if r["op"] == o["op"] and
                 r["verdict"] == "pass"] or [0]) for o in ops]
    ax.barh(list(y), best, color="tab:green")
    ax.axvline(1.0, color="k", lw=1)
    ax.set_yticks(list(y), [o["op"] for o in ops])
    ax.set_xlabel("best verified speedup over the baseline" + cpu)
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
    ax.set_ylabel("speedup (x = rejected; CPU: not timed)")
    if ops:
        ax.legend(fontsize=7)
    paths["candidate_history"] = _save(fig, plt, out / "candidate_history.png")
    return paths


def headline_lines(state: Any) -> list[str]:
    """The served step against its floor, per batch size: from the end-to-end bench where it
    ran, else from the profile of the tuned set before the run."""
    e = state.data.get("e2e") or {}
    cpu = not _meaningful(state)
    note = " — CPU: times not meaningful" if cpu else ""
    if e.get("ran") and Path(e["json"]).is_file():
        data = json.loads(Path(e["json"]).read_text())
        sets = data["kernels"]
        out = [f"`autoopt bench model` in this run ({data['gpu']}, {data['layers']} layers){note}:",
               "", "| batch | context | floor ms | " + " | ".join(f"{k} ms (x floor)"
                                                          for k in sets) + " |",
               "|---:|---:|---:|" + "---:|" * len(sets)]
        for b, c in sorted({(r["batch"], r["context"]) for r in data["rows"]}):
            rows = {r["kernels"]: r for r in data["rows"] if (r["batch"], r["context"]) == (b, c)}
            floor = next((r["floor_ms"] for r in rows.values() if r["ran"]), None)
            cells = [f"{rows[k]['median_ms']:.3f} ({rows[k]['x_floor']:.1f}x)"
                     + (", eager" if not cpu and rows[k].get("graph_bucket") is None else "")
                     if k in rows and rows[k]["ran"] else "not run" for k in sets]
            out.append(f"| {b} | {c} | {_fmt(floor, '.3f')} | " + " | ".join(cells) + " |")
        if any(not cpu and r["ran"] and r.get("graph_bucket") is None for r in data["rows"]):
            out += ["", "eager: that step was not replayed from a CUDA graph (its capture failed "
                    "or was not possible; e2e/bench_model.md's notes say why), so it is slower "
                    "than the step a server would run."]
        return out
    by_batch = (state.data.get("profile") or {}).get("by_batch") or {}
    if not by_batch:
        return ["not measured (the run stopped before profiling)"]
    out = [f"The tuned set before the run (profile; the end-to-end check did not run){note}:",
           "", "| batch | step ms | floor ms | x floor |", "|---:|---:|---:|---:|"]
    for b, p in sorted(by_batch.items(), key=lambda kv: int(kv[0])):
        floor = p.get("floor_us")
        x = p["step_us"] / floor if floor else None
        floor_ms = floor / 1e3 if floor else None
        out.append(f"| {b} | {p['step_us'] / 1e3:.3f} | {_fmt(floor_ms, '.3f')} | "
                   f"{_fmt(x, '.1f')} |")
    return out


def time_split_lines(state: Any) -> list[str]:
    """Where each profiled step's time went: kernels, the device idle inside the CUDA graph,
    and the host's share outside it (input copies, scheduling, sampling), which no kernel
    removes."""
    from .profiler.attribution import GRAPH_IDLE, IDLE, OUTSIDE

    by_batch = (state.data.get("profile") or {}).get("by_batch") or {}
    if not by_batch:
        return []
    out = ["## Where the served step's time goes (profile of the tuned set)", "",
           "| batch | context | step ms | kernels ms | idle ms | outside the graph ms (share) |",
           "|---:|---:|---:|---:|---:|---:|"]
    for b, p in sorted(by_batch.items(), key=lambda kv: int(kv[0])):
        lines = {r["op"]: r["time_us"] for r in p["rows"] if r["op"] in (GRAPH_IDLE, IDLE,
                                                                          OUTSIDE)}
        kernels = sum(r["time_us"] for r in p["rows"] if r["op"] not in lines)
        step = p["step_us"]
        outside = lines.get(OUTSIDE)
        share = f" ({100 * outside / step:.0f}%)" if outside is not None and step else ""
        out.append(f"| {b} | {p.get('context', '-')} | {step / 1e3:.3f} | {kernels / 1e3:.3f} | "
                   f"{_fmt(_ms(lines.get(GRAPH_IDLE, lines.get(IDLE))), '.3f')} | "
                   f"{_fmt(_ms(outside), '.3f')}{share} |")
    return out + ["", "idle: the gaps between the graph's kernels where the step was replayed "
                  "from a CUDA graph; between ops where it ran eagerly (there the host's time "
                  "is inside the step, and there is no outside column).", ""]


def _ms(us: float | None) -> float | None:
    return us / 1e3 if us is not None else None


def write_report(state: Any, ctx: Any) -> Path:
    """`report.md` in the run directory, with the plots next to it."""
    d, out = state.data, state.run_dir
    plots = write_plots(state, out / "plots")
    prof = d.get("profile") or {}
    cpu = not ctx.meaningful
    lines = [f"# autoopt optimize: {d['target']}", "", "## The served step against its floor",
             ""] + headline_lines(state) + [
             "", f"Run {out.name}; agent {d['args'].get('agent')}; created {d['created']}; phase "
             f"{d['phase']}. Device: {prof.get('gpu')}" + (f"; {ctx.proxy_note}" if
                                                          ctx.proxy_note else "") + ".",
             f"Profile: the served step with the {prof.get('kernels')} set at batch "
             f"{', '.join((prof.get('by_batch') or {}).keys())}, {prof.get('layers')} layers, "
             f"backend {prof.get('backend')}.", ""]
    lines += _plan_lines(d.get("plan"))
    lines += time_split_lines(state)
    if cpu:
        lines += ["**CPU run: speed was not judged.** On the CPU (Triton interpreter) nothing is "
                  "timed: every verified candidate was registered as `candidate` (never "
                  "accepted or locked), so a person or a GPU run decides.", ""]
    else:
        lines += ["A verified candidate wins when its speedup over the current selection "
                  "(geometric mean over the token buckets the target serves) exceeds 1 + max(2%, "
                  f"the timing noise); winners are "
                  f"{'accepted and locked' if ctx.auto_accept else 'candidates'}.", ""]
    lines += ["## Ops by time above the floor (summed over the profiled batch sizes)", "",
              "| op | status | time µs | floor µs | gap µs | gap µs per batch | baseline | "
              "attempts | registered | stop |", "|---|---|---|---|---|---|---|---|---|---|"]
    for o in d["ops"]:
        regs = ", ".join(r["variant"] for r in o.get("registered") or []) or "-"
        per = ", ".join(f"{b}: {_fmt(g.get('gap_us'), '.1f')}"
                        for b, g in (o.get("by_batch") or {}).items()) or "-"
        lines.append(f"| {o['op']} | {o['status']} | {_fmt(o.get('time_us'))} | "
                     f"{_fmt(o.get('floor_us'))} | {_fmt(o.get('gap_us'))} | {per} | "
                     f"{o.get('baseline', '-')} | {o.get('attempts', 0)} | {regs} | "
                     f"{o.get('stop_reason') or o.get('note') or '-'} |")
    lines += ["", "## Attempts", "", "| op | # | candidate | verdict | speedup | outcome | "
              "first reason |", "|---|---|---|---|---|---|---|"]
    for r in _attempt_rows(state):
        reason = (r["reasons"] or [""])[0].replace("|", "/")[:140]
        lines.append(f"| {r['op']} | {r['index']} | {r['candidate']} | {r['verdict']} | "
                     f"{_fmt(r['speedup'], '.3g')} | {r['outcome']} | {reason} |")
    lines += ["", "## Cost", ""] + cost_lines(d.get("costs"))
    lines += ["", "## End-to-end check (bench model)", ""] + _e2e_lines(d.get("e2e"))
    if (d.get("e2e") or {}).get("png"):
        plots["bench_model"] = Path(d["e2e"]["png"])
    lines += ["", "## Plots", ""] + [f"![{k}]({p.relative_to(out)})" for k, p in plots.items()]
    reg = ctx.registry.root
    lines += ["", "## Review", "", f"`autoopt review list --registry {reg}` lists what waits for "
              "review; `autoopt review show OP VARIANT` shows source, diff, evidence and "
              "timings; `git diff` of the registry shows every file this run wrote."]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def cost_lines(costs: dict | None) -> list[str]:
    """What the run spent: per agent session, API calls, tokens and USD (priced per model from
    the API's usage fields); per evaluation worker, jobs and device seconds."""
    from .budget import Ledger

    ledger = Ledger(costs)
    t = ledger.totals()
    out = [f"Total: ${t['usd']:.4f} for {t['calls']} API call(s) ({t['input_tokens']:,} input, "
           f"{t['output_tokens']:,} output, {t['cache_creation_input_tokens']:,} cache-write, "
           f"{t['cache_read_input_tokens']:,} cache-read tokens); {t['device_s']:.1f} s of "
           f"device time over {t['jobs']} job(s) on {t['workers']} worker(s).", ""]
    if ledger.api:
        out += ["| session | model | calls | input | output | cache write | cache read | USD |",
                "|---|---|---:|---:|---:|---:|---:|---:|"]
        out += [f"| {k} | {r['model']} | {r['calls']} | {r['input_tokens']:,} | "
                f"{r['output_tokens']:,} | {r['cache_creation_input_tokens']:,} | "
                f"{r['cache_read_input_tokens']:,} | {r['usd']:.4f} |"
                for k, r in sorted(ledger.api.items())]
        out.append("")
    if ledger.device:
        out += ["| worker | jobs | device s | by kind |", "|---|---:|---:|---|"]
        out += [f"| {w} | {r['jobs']} | {r['seconds']:.1f} | " + ", ".join(
                    f"{k} {b['jobs']} ({b['seconds']:.1f} s)" for k, b in
                    sorted(r["by_kind"].items())) + " |"
                for w, r in sorted(ledger.device.items())]
    out += [f"- lost worker: {line}" for line in ledger.lost]
    return out


def _plan_lines(plan: dict | None) -> list[str]:
    if not plan:
        return []
    out = [f"Plan for the {plan['budget_s']:.0f} s budget (the whole command):", ""]
    out += [f"- {s['name']}: {s['seconds']:.0f} s, {s['what']}" for s in plan["stages"]]
    return out + [""]


def _e2e_lines(e: dict | None) -> list[str]:
    if not e:
        return ["not run"]
    if not e.get("ran"):
        return [f"not run: {e.get('why')}"]
    out = [f"Kernel sets: {', '.join(e['kernels'])}"
           + (f"; the new set takes {', '.join(f'{k}: {v}' for k, v in e['sources'].items())}"
              if e.get("sources") else "; no variant was registered in this run") + ".",
           f"Full table: {Path(e['md']).name} (e2e/), JSON: e2e/{Path(e['json']).name}."]
    if e.get("parity") is not None:
        out.append(f"Parity of the new set with the reference: "
                   f"{'PASS' if e['parity'] else 'FAIL'} (top-1 agree and max |diff| <= "
                   f"{e['max_abs_bound']} at every batch size)")
    out += [f"- not run: {s}" for s in e.get("skipped") or []]
    return out
