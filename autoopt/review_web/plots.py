"""Time per token bucket, drawn on the server (matplotlib, SVG): one chart per timing group.

Lines: the op's reference, torch.compile of it, what the candidate would replace (`current`),
the candidate, and the floor (bytes moved at the GPU's bandwidth). Both axes are logarithmic:
decode buckets are a few tokens and prefill ones thousands, and times span as much. A series with
no number at a bucket is not drawn there.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Sequence

from matplotlib.figure import Figure

from .evidence import TimingGroup

SERIES = (("reference_us", "reference", "#6b7280", "o", "-"),
          ("compile_us", "torch.compile", "#8b5cf6", "s", "-"),
          ("current_us", "current", "#2563eb", "^", "--"),
          ("median_us", "candidate", "#dc2626", "D", "-"),
          ("floor_us", "floor", "#16a34a", "", ":"))
# matplotlib's text layout (mathtext tick labels on log axes) is not thread-safe, and the server
# draws each page's charts from its worker threads at once.
_DRAW = threading.Lock()


def time_per_bucket_svg(group: TimingGroup, candidate: str, current: str) -> bytes:
    """The chart as SVG bytes (no scripts, fonts as paths)."""
    with _DRAW:
        return _draw(group, candidate, current)


def _draw(group: TimingGroup, candidate: str, current: str) -> bytes:
    fig = Figure(figsize=(7.0, 3.4), dpi=100)
    ax = fig.subplots()
    labels = {"current_us": f"current ({current})", "median_us": f"candidate ({candidate})"}
    if any(r.get("compile_from") for r in group.rows):
        labels["compile_us"] = f"torch.compile (as timed for {current})"
    drawn = 0
    for key, label, color, marker, style in SERIES:
        pts = [(r["T"], r[key]) for r in group.rows
               if isinstance(r.get("T"), int | float) and isinstance(r.get(key), int | float)
               and r[key] > 0]
        if not pts:
            continue
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker=marker or None, linestyle=style, color=color, markersize=4,
                linewidth=1.6, label=labels.get(key, label))
        drawn += 1
    _axes(ax, group, drawn, [r["T"] for r in group.rows])
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="svg", metadata={"Date": None})
    return buf.getvalue()


def _axes(ax, group: TimingGroup, drawn: int, ts: Sequence) -> None:
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted({t for t in ts if isinstance(t, int | float) and t > 0})
    if ticks:
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.minorticks_off()
    ax.set_xlabel("tokens (T)")
    ax.set_ylabel("µs per call (median)")
    title = group.title + ("" if group.meaningful else " — CPU timings: not meaningful")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    if drawn:
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    else:
        ax.text(0.5, 0.5, "no timings recorded", ha="center", va="center",
                transform=ax.transAxes)
