"""A review-page fixture: a copy of the committed kernels/ plus one candidate awaiting review,
its optimize run, and a Chromium driven by Playwright against `autoopt review serve`.

The candidate is a small honest Triton swiglu (rows of tiles, the reference's one rounding),
registered through `model.registry.writers.register` with the judge's real CPU report
(`autoopt.eval.verify_variant` under the Triton interpreter) and real CPU timings, labelled not
meaningful as every CPU timing is. Its run directory is laid out as `autoopt optimize` writes
one (state.json, attempts.jsonl, report.md, a plot, the candidate file and its report, and a
transcript in the Claude agent's format: the conversation itself is made up for the test).
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

from model.registry import ConfigTable, Provenance, Registry, Verification, shipped_root, writers

OP, NAME, RUN, CANDIDATE = "swiglu", "claude_rows_v1", "20261201-120000-cpu-tiny", "a01_rows"
# What a candidate for OP would replace on the H200: the shipped lock's selection for sm_90.
SELECTED_SM90 = Registry(shipped_root()).read_lock().section("sm_90")[OP].variant
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
SHAPES = [{"T": 1, "I": 64}, {"T": 3, "I": 96}]
FIXED = "2026-12-01T12:34:56+00:00"  # the writers' clock in byte-for-byte comparisons

SOURCE = '''"""swiglu rows: out = bf(f32(g) / (1 + exp(-f32(g))) * f32(up)), ROWS tokens a program.

One rounding point (the BF16 output, round-to-nearest-even on the bits), an IEEE divide, expf as
torch calls it. Memory traffic: read 2*T*I bf16, write T*I bf16.
"""

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

CONFIG_SPACE = {"ROWS": [1, 2, 4], "BLOCK": [256, 1024]}
DEFAULT_CONFIG = {"ROWS": 2, "BLOCK": 256}


@triton.jit
def _swiglu_rows_kernel(g_ptr, u_ptr, o_ptr, T, C, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                        ON_GPU: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)[None, :]
    m = (rows < T) & (cols < C)
    at = rows.to(tl.int64) * C + cols
    g = (tl.load(g_ptr + at, mask=m, other=0.0).to(tl.uint16, bitcast=True).to(tl.uint32)
         << 16).to(tl.float32, bitcast=True)
    u = (tl.load(u_ptr + at, mask=m, other=0.0).to(tl.uint16, bitcast=True).to(tl.uint32)
         << 16).to(tl.float32, bitcast=True)
    if ON_GPU:
        e = libdevice.exp(-g)
    else:
        e = tl.exp((-g).to(tl.float64)).to(tl.float32)
    y = tl.div_rn(g, 1.0 + e) * u
    bits = y.to(tl.uint32, bitcast=True)
    hi = bits >> 16
    out = tl.where(y != y, 0x7FC0, hi + (((bits & 0xFFFF) + 0x7FFF + (hi & 1)) >> 16))
    tl.store(o_ptr + at, out.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=m)


def swiglu_rows(gate, up, rows, block):
    gate, up = gate.contiguous(), up.contiguous()
    t, c = gate.shape
    out = torch.empty_like(gate)
    if out.numel():
        grid = (triton.cdiv(t, rows), triton.cdiv(c, block))
        _swiglu_rows_kernel[grid](gate, up, out, t, c, ROWS=rows, BLOCK=block,
                                  ON_GPU=gate.is_cuda)
    return out


def run(gate, up, config=None):
    cfg = {**DEFAULT_CONFIG, **(config or {})}
    return swiglu_rows(gate, up, cfg["ROWS"], cfg["BLOCK"])
'''


def judge(work: Path) -> tuple[dict, list[dict]]:
    """The judge's report and CPU timing rows of SOURCE (real runs, a few seconds)."""
    from autoopt.registry_record import bench, verify

    path = work / f"{CANDIDATE}.py"
    path.write_text(SOURCE)
    report = verify(OP, path, "cpu", (0,), SHAPES, timeout_s=300)
    rows = bench(OP, path, [("cpu-tiny", s) for s in SHAPES], "cpu", warmup=1, iters=3,
                 compile=False, timeout_s=300)
    return report, rows


@functools.lru_cache(maxsize=1)
def judged() -> tuple[dict, list[dict]]:
    """`judge` once per test process (the HTTP and browser tests share it)."""
    work = Path(tempfile.mkdtemp(prefix="review-web-"))
    atexit.register(shutil.rmtree, work, True)
    return judge(work)


def cli(*args: str):
    """`autoopt ...` in-process, wide enough that rich wraps nothing."""
    from typer.testing import CliRunner

    from autoopt.cli import app

    return CliRunner().invoke(app, list(args), catch_exceptions=False, env={"COLUMNS": "240"})


def build(root: Path, report: dict, rows: list[dict]) -> tuple[Registry, Path]:
    """(registry, runs dir) under `root`: kernels/ copied, the candidate registered."""
    reg = Registry(root / "registry")
    shutil.copytree(shipped_root(), reg.root, ignore=shutil.ignore_patterns("__pycache__",
                                                                            "*.pyc"))
    check = Verification.from_report("cpu", report, source=f"{OP}/{NAME}.py")
    rows = [{**r, "config": {"ROWS": 2, "BLOCK": 256}} for r in rows]
    prov = Provenance("claude", model="claude-test", parent="triton_v1", run=RUN,
                      time="2026-12-01T12:00:00+00:00")
    optimize = {"run": RUN, "speedup": 1.0, "baseline": "triton_v1", "speed_judged": False,
                "profile_row": {"op": OP, "calls": 3, "time_us": 50.0, "floor_us": 1.0,
                                "bytes_source": "cost model"}}
    writers.register(reg, OP, NAME, SOURCE.encode(), prov, [check], rows,
                     ConfigTable.from_rows(OP, "cpu", rows), optimize,
                     "verified on CPU: speed not judged")
    writers.note(reg, OP, f"\n## {NAME} (2026-12-01T12:00:00, agent claude, run {RUN})\n\n"
                          "Hypothesis: two rows per program halve the launches at decode.\n")
    runs = root / "runs"
    write_run(runs / RUN, report, check.sha256)
    return reg, runs


def write_run(run: Path, report: dict, sha: str) -> None:
    cands = run / "ops" / OP / "candidates"
    cands.mkdir(parents=True)
    (cands / f"{CANDIDATE}.py").write_text(SOURCE)
    (cands / f"{CANDIDATE}.verify.json").write_text(json.dumps([report], default=str))
    (run / "state.json").write_text(json.dumps({
        "version": 1, "target": "cpu-tiny", "args": {"agent": "claude"}, "phase": "done",
        "created": "2026-12-01T12:00:00"}))
    attempt = {"index": 1, "op": OP, "candidate": CANDIDATE, "sha256": sha, "verdict": "pass",
               "reasons": [], "speedup": 1.0, "meaningful": False, "agent": "claude",
               "outcome": f"registered {OP}/{NAME} as candidate",
               "notes": "Hypothesis: two rows per program halve the launches at decode."}
    (run / "attempts.jsonl").write_text(json.dumps({"attempt": attempt, "proposal": {}}) + "\n")
    (run / "report.md").write_text(f"# autoopt optimize: cpu-tiny\n\nRun {RUN}.\n\n"
                                   "![time_per_op](plots/time_per_op.png)\n\n<script>x</script>\n")
    (run / "plots").mkdir()
    _tiny_png(run / "plots" / "time_per_op.png")
    transcript = [
        {"kind": "session_start", "op": OP},
        {"kind": "response", "content": [
            {"type": "text", "text": "The reference launches one kernel per row; I will tile "
                                     "two rows per program."},
            {"type": "tool_use", "id": "t1", "name": "submit_variant",
             "input": {"name_hint": "rows", "source": SOURCE}}]},
        {"kind": "harness_feedback", "tool_use_id": "t1", "attempt": attempt}]
    (run / "ops" / OP / "transcript.jsonl").write_text(
        "".join(json.dumps(e) + "\n" for e in transcript))


def _tiny_png(path: Path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(2, 1), dpi=50)
    fig.subplots().bar(["a", "b"], [1, 2])
    fig.savefig(path, format="png")


def files(root: Path) -> dict[str, bytes]:
    """Every file under `root` by relative path (what a write left behind)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and "__pycache__" not in p.parts}
