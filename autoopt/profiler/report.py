"""A profile for people: the rich table, `profile.json`, the bar chart, and side-by-side compare."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .. import env
from .attribution import LINES, OTHER, Profile

_COLUMNS = ("op", "calls", "kernels", "time", "share", "bytes", "GB/s", "floor", "gap")


def fmt_us(us: float | None) -> str:
    if us is None:
        return "-"
    if abs(us) >= 1e6:
        return f"{us / 1e6:.2f} s"
    if abs(us) >= 1e3:
        return f"{us / 1e3:.2f} ms"
    return f"{us:.1f} µs"


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def title(p: Profile) -> str:
    where = p.proxy or p.gpu
    return (f"{p.target} ({p.phase}) batch {p.batch}, context {p.context}, {p.layers} layers, "
            f"{p.kernels} kernels, on {where}")


def profile_table(p: Profile) -> Table:
    table = Table(title=title(p), caption=f"backend: {p.backend_note}")
    for i, col in enumerate(_COLUMNS):
        table.add_column(col, justify="left" if i == 0 else "right")
    for r in p.rows:
        style = "dim" if r.op == OTHER or r.op in LINES else None
        b = fmt_bytes(r.bytes) + (" *" if r.bytes_source == "cost model" else "")
        table.add_row(r.op, str(r.calls or "-"), str(r.kernels or "-"), fmt_us(r.time_us),
                      f"{r.share:.1f}%", b, f"{r.gbps:.3g}" if r.gbps else "-",
                      fmt_us(r.floor_us), fmt_us(r.gap_us), style=style)
    table.add_section()
    table.add_row("step", "", str(sum(r.kernels for r in p.rows)), fmt_us(p.step_us), "100%",
                  "", "", fmt_us(p.floor_us), fmt_us(p.step_us - p.floor_us))
    return table


def floor_line(p: Profile) -> str:
    f = p.floor
    if not f:
        return ""
    touched = f.get("experts_touched") or ()
    mean = sum(touched) / len(touched) if touched else 0
    return (f"floor {fmt_us(p.floor_us)} ({f['bound']}-bound): {fmt_bytes(f['weight_bytes'])} of "
            f"weights read (experts: {mean:.1f} of {f['experts_held']} per MoE layer, routing "
            f"{f['routing']}) + {fmt_bytes(f['kv_bytes'])} of KV")


def summary(p: Profile) -> list[str]:
    c = p.checks
    graph = (f"graph replay span {fmt_us(p.graph_step_us)} (bucket {c.get('graph_bucket')}, "
             f"{c.get('kernels_in_graph')} kernels in the graph, "
             f"{100 * c.get('aligned_fraction', 0):.1f}% aligned to ops)"
             if p.graph_step_us else "no CUDA graph (eager step)")
    lines = [
        f"step {fmt_us(p.step_us)} ({p.step_source}); kernels {fmt_us(p.kernel_us)}; "
        f"floor {fmt_us(p.floor_us)} (step / floor = {p.step_us / p.floor_us:.1f}x)"
        if p.floor_us else f"step {fmt_us(p.step_us)}; kernels {fmt_us(p.kernel_us)}",
        floor_line(p),
        f"{graph}; {c.get('kernels_per_step')} kernels per step "
        f"({c.get('kernels_per_step', 0) / max(p.layers, 1):.0f} per layer)",
        f"ceilings: {p.rates.bandwidth_bytes_s / 1e12:.2f} TB/s, "
        f"{p.rates.bf16_flops_s / 1e12:.0f} BF16 TFLOP/s, {p.rates.source}"
        + ("" if p.rates.meaningful else " (not meaningful here: floors are nominal)"),
        "bytes marked * are the op cost model's, not measured",
        f"attribution: {p.attribution_note}",
    ]
    if p.proxy:
        lines.insert(0, p.proxy)
    return lines + [f"note: {n}" for n in p.notes]


def print_profile(p: Profile, console: Console) -> None:
    console.print(profile_table(p))
    for line in summary(p):
        console.print(line)


def write_chart(p: Profile, path: str | Path) -> Path:
    """Horizontal bars: time per op next to its floor (log scale), the idle line included."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in p.rows if r.time_us > 0 or r.floor_us][::-1]
    values = [v for r in rows for v in (r.time_us, r.floor_us) if v]
    low = min(values) / 2 if values else 1e-3
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(rows) + 2.0))
    y = list(range(len(rows)))
    ax.barh([i + 0.2 for i in y], [max(r.time_us, low) for r in rows], height=0.4, left=0,
            label="time", color="tab:blue")
    with_floor = [(i, r.floor_us) for i, r in zip(y, rows) if r.floor_us]
    ax.barh([i - 0.2 for i, _ in with_floor], [f for _, f in with_floor], height=0.4,
            label="floor (cost model / ceilings)", color="tab:green")
    ax.set_yticks(y, [r.op for r in rows])
    ax.set_xscale("log")
    ax.set_xlim(left=low)
    ax.set_xlabel("µs per step (log)")
    ax.set_title(f"{title(p)}\nstep {fmt_us(p.step_us)}, kernels {fmt_us(p.kernel_us)}, floor "
                 f"{fmt_us(p.floor_us)}; {p.backend}", fontsize=9)
    ax.legend(loc="best")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def default_out_dir(target: str) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return env.runs_dir() / f"{stamp}-profile-{Path(target).stem}"


def write_outputs(p: Profile, out_dir: str | Path, stem: str = "profile") -> tuple[Path, Path]:
    """`<stem>.json` and `<stem>.png` in `out_dir` (created)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return p.save(out / f"{stem}.json"), write_chart(p, out / f"{stem}.png")


@dataclass(frozen=True)
class CompareRow:
    """One op of `autoopt profile --compare A B`: A's and B's time (µs) and share, speedup A/B."""

    op: str
    a_us: float | None
    b_us: float | None
    a_share: float | None
    b_share: float | None
    floor_us: float | None

    @property
    def speedup(self) -> float | None:
        return self.a_us / self.b_us if self.a_us and self.b_us else None


def compare_rows(a: Profile, b: Profile) -> list[CompareRow]:
    """A's ops in A's order, then B's ops that A lacks (the rows of every compare view)."""
    order = [r.op for r in a.rows] + [r.op for r in b.rows if r.op not in {x.op for x in a.rows}]
    rows_a, rows_b = {r.op: r for r in a.rows}, {r.op: r for r in b.rows}
    out = []
    for op in order:
        ra, rb = rows_a.get(op), rows_b.get(op)
        out.append(CompareRow(op, ra.time_us if ra else None, rb.time_us if rb else None,
                              ra.share if ra else None, rb.share if rb else None,
                              (ra or rb).floor_us))
    return out


def step_speedup(a: Profile, b: Profile) -> float | None:
    return a.step_us / b.step_us if b.step_us else None


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}%"


def compare_table(a: Profile, b: Profile, names: tuple[str, str] = ("A", "B")) -> Table:
    """Per-op time of two profiles side by side with the speedup A/B."""
    table = Table(title=f"{names[0]}: {title(a)}\n{names[1]}: {title(b)}")
    for col in ("op", f"{names[0]} time", f"{names[1]} time", "speedup", f"{names[0]} share",
                f"{names[1]} share", "floor"):
        table.add_column(col, justify="left" if col == "op" else "right")
    for r in compare_rows(a, b):
        table.add_row(r.op, fmt_us(r.a_us), fmt_us(r.b_us), _x(r.speedup), _pct(r.a_share),
                      _pct(r.b_share), fmt_us(r.floor_us))
    table.add_section()
    table.add_row("step", fmt_us(a.step_us), fmt_us(b.step_us), _x(step_speedup(a, b)), "", "",
                  "")
    return table


def compare_markdown(a: Profile, b: Profile, names: tuple[str, str] = ("A", "B")) -> list[str]:
    """The compare table as markdown lines (times in µs, one decimal), then the whole step."""
    n0, n1 = names
    out = [f"| op | {n0} µs | {n1} µs | speedup | {n0} share | {n1} share | floor µs |",
           "|---|---|---|---|---|---|---|"]
    f1 = (lambda v: "-" if v is None else f"{v:.1f}")
    for r in compare_rows(a, b):
        out.append(f"| {r.op} | {f1(r.a_us)} | {f1(r.b_us)} | {_x(r.speedup)} | "
                   f"{_pct(r.a_share)} | {_pct(r.b_share)} | "
                   f"{'-' if r.floor_us is None else f'{r.floor_us:.2f}'} |")
    out.append(f"| **step** | {a.step_us:.1f} | {b.step_us:.1f} | {_x(step_speedup(a, b))} | "
               f"100% | 100% | {'-' if not a.floor_us else f'{a.floor_us:.1f}'} |")
    return out


def write_compare_chart(a: Profile, b: Profile, path: str | Path,
                        names: tuple[str, str] = ("A", "B")) -> Path:
    """Horizontal bars: each op's time in A next to its time in B (log scale), step in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in compare_rows(a, b) if r.a_us or r.b_us][::-1]
    values = [v for r in rows for v in (r.a_us, r.b_us) if v]
    low = min(values) / 2 if values else 1e-3
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(rows) + 2.0))
    y = list(range(len(rows)))
    ax.barh([i + 0.2 for i in y], [max(r.a_us or 0, low) for r in rows], height=0.4,
            label=names[0], color="tab:gray")
    ax.barh([i - 0.2 for i in y], [max(r.b_us or 0, low) for r in rows], height=0.4,
            label=names[1], color="tab:blue")
    ax.set_yticks(y, [r.op for r in rows])
    ax.set_xscale("log")
    ax.set_xlim(left=low)
    ax.set_xlabel("µs per step (log)" + ("" if a.rates.meaningful else
                                         " (CPU: not meaningful)"))
    # Not title(): a lock path as the kernels would run off the figure.
    ax.set_title(f"{names[0]} vs {names[1]}: {b.target} ({b.phase}) batch {b.batch}, {b.layers} "
                 f"layers, on {b.proxy or b.gpu}\nstep {fmt_us(a.step_us)} -> "
                 f"{fmt_us(b.step_us)} ({_x(step_speedup(a, b))})", fontsize=9)
    ax.legend(loc="best")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def compare_warnings(a: Profile, b: Profile) -> list[str]:
    out = []
    for key in ("target", "batch", "context", "layers", "gpu"):
        if getattr(a, key) != getattr(b, key):
            out.append(f"the profiles differ in {key}: {getattr(a, key)} vs {getattr(b, key)}")
    return out


def print_compare(a_path: Path, b_path: Path, console: Console) -> tuple[Profile, Profile]:
    a, b = Profile.load(a_path), Profile.load(b_path)
    console.print(f"A = {a_path}\nB = {b_path}")
    console.print(compare_table(a, b))
    for w in compare_warnings(a, b):
        console.print(f"[yellow]warning:[/] {w}")
    return a, b


# ---- CLI commands (autoopt/cli.py parses the flags) ---------------------------------------------
def targets_command(args, console: Console) -> None:
    from ..targets import list_targets, load_target

    if args.name:
        t = load_target(args.name)
        batch = args.batch or t.batch_sizes[0]
        table = Table(title=f"{t.name}: per-rank op shapes at batch {batch}, context "
                            f"{t.contexts[0]} (TP{t.tp}, EP{t.ep}, {t.default_layers} layers)")
        for col in ("op", "calls/step", "shape", "bytes/call", "FLOPs/call"):
            table.add_column(col)
        for c in t.step_calls(batch):
            table.add_row(c.name, str(c.count), ", ".join(f"{k}={v}" for k, v in c.shape.items()),
                          fmt_bytes(c.cost.bytes), f"{c.cost.flops:.3g}")
        console.print(table)
        return
    table = Table(title="targets (tasks/*.toml)")
    for col in ("name", "gpu", "arch", "TP/EP", "phase", "batches", "contexts", "model", "layers",
                "HBM TB/s", "BF16 TFLOP/s"):
        table.add_column(col)
    for name in list_targets():
        t = load_target(name)
        hw = t.hardware
        table.add_row(t.name, hw.gpu.replace("NVIDIA ", ""), hw.arch, f"{t.tp}/{t.ep}", t.phase,
                      ",".join(map(str, t.batch_sizes)), ",".join(map(str, t.contexts)), t.model,
                      str(t.default_layers), f"{hw.hbm_tb_s:g}", f"{hw.bf16_tflop_s:g}")
    console.print(table)


def profile_command(args, console: Console) -> int:
    """Run `autoopt profile`; returns the exit code (2: the request was wrong)."""
    from ..targets import TargetError
    from . import profile_step

    try:
        if args.compare:
            print_compare(args.compare[0], args.compare[1], console)
            return 0
        if not args.target:
            console.print("[red]error:[/] give --target NAME (see `autoopt targets`) or "
                          "--compare A.json B.json")
            return 2
        kw = {k: getattr(args, k) for k in ("kernels", "backend") if getattr(args, k)}
        p = profile_step(args.target, batch=args.batch, layers=args.layers, proxy=args.proxy,
                         context=args.context, eager=args.eager,
                         attention_backend=args.attention_backend,
                         ncu_sample=args.ncu_sample, **kw)
    except (TargetError, ValueError) as e:
        console.print(f"[red]error:[/] {e}")
        return 2
    print_profile(p, console)
    json_path, png_path = write_outputs(p, args.out or default_out_dir(p.target))
    console.print(f"wrote {json_path} and {png_path}")
    return 0


def ceilings_command(args, console: Console) -> int:
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        console.print("[red]error:[/] no CUDA GPU here: ceilings are measured on the GPU that "
                      "runs the target (CPU floors are nominal, see the cpu-tiny target)")
        return 2
    try:
        from ..eval.timing import measure_ceilings
    except ImportError as e:
        console.print(f"[red]error:[/] autoopt.eval.timing is not available ({e})")
        return 2
    c = measure_ceilings(args.device)
    table = Table(title=f"ceilings of {c.gpu} (cached per GPU name)")
    for col in ("copy (read+write)", "BF16 matmul", "FP32 matmul", "meaningful"):
        table.add_column(col, justify="right")
    table.add_row(f"{c.copy_bytes_s / 1e12:.2f} TB/s", f"{c.bf16_flops_s / 1e12:.0f} TFLOP/s",
                  f"{c.fp32_flops_s / 1e12:.1f} TFLOP/s", str(c.meaningful))
    console.print(table)
    return 0
