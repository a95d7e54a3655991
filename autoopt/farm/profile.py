"""`profile_candidate`: Nsight Compute metrics of a verified candidate's kernels.

`ncu` runs a child (`python -m autoopt.farm.profile`) that loads the candidate, calls it once
per shape outside any range (Triton compiles and caches there), then once per shape inside the
NVTX range `autoopt_candidate` with the shape's bucket (`T=n`) inside it; ncu profiles only
kernels in that range, at most `launch_count` of them, with its default cache control (caches
flushed before each kernel) and `--clock-control none` (the clocks the timings and the measured
ceiling see). Only candidates the judge passed are profiled; the numbers inform the agent and
decide nothing.

Per kernel: duration; DRAM bytes read and written, their rate as a share of the copy bandwidth
`measure_ceilings` measured on this GPU; achieved occupancy; registers per thread; shared memory
per block (static + dynamic); block and grid; L2 hit rate; the top warp-stall reasons (cycles
per issued instruction). `ncu --import --csv --page raw --print-units base` is read by
`parse_csv`, which takes the long (one row per metric) and the wide (one row per kernel) forms.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

RANGE = "autoopt_candidate"
STALLS = ("long_scoreboard", "short_scoreboard", "barrier", "membar", "mio_throttle",
          "lg_throttle", "math_pipe_throttle", "tex_throttle", "wait", "not_selected",
          "selected", "no_instruction", "branch_resolving", "dispatch_stall", "drain",
          "imc_miss", "misc", "sleeping")
STALL = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
METRICS = {
    "duration_ns": "gpu__time_duration.sum",
    "dram_read": "dram__bytes_read.sum",
    "dram_write": "dram__bytes_write.sum",
    "dram_pct_peak": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "registers": "launch__registers_per_thread",
    "smem_static": "launch__shared_mem_per_block_static",
    "smem_dynamic": "launch__shared_mem_per_block_dynamic",
    "block": "launch__block_size",
    "grid": "launch__grid_size",
    "l2_hit_pct": "lts__t_sector_hit_rate.pct",
    **{f"stall_{s}": STALL.format(s) for s in STALLS},
}
_UNITS = {"nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6,
          "second": 1e9, "byte": 1.0, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9}
_BUCKET = re.compile(r"T=\d+")


def ncu_command(ncu: str, report: Path, child: list[str], launch_count: int) -> list[str]:
    return [ncu, "--nvtx", "--nvtx-include", f"{RANGE}/", "--clock-control", "none",
            "--metrics", ",".join(METRICS.values()), "--launch-count", str(launch_count),
            "--target-processes", "all", "-f", "-o", str(report), *child]


def import_command(ncu: str, report: Path) -> list[str]:
    return [ncu, "--import", str(report), "--csv", "--page", "raw", "--print-units", "base"]


def child_command(op: str, path: Path, shapes: list[dict], per_bucket: dict) -> list[str]:
    return [sys.executable, "-m", "autoopt.farm.profile", "--op", op, "--source", str(path),
            "--shapes", json.dumps(shapes), "--configs", json.dumps(per_bucket)]


def profile_candidate(op: str, path: Path, device: str, shapes: list[dict], per_bucket: dict,
                      launch_count: int, timeout_s: float, tmp: Path) -> dict:
    """{"kernels": [...], "ceiling_gb_s", "ncu", ...} or {"message": why there is nothing}."""
    from autoopt.profiler.nsight import find_ncu, ncu_version

    if not device.startswith("cuda"):
        return {"message": "no GPU on this worker: Nsight Compute profiles GPU kernels only, so "
                           "there are no metrics here (the CPU run verifies and never times)"}
    ncu = find_ncu()
    if ncu is None:
        return {"message": "ncu (Nsight Compute CLI) not found on this GPU worker (PATH, "
                           "/usr/local/cuda/bin or AUTOOPT_NCU): no metrics"}
    report = tmp / "candidate"
    cmd = ncu_command(ncu, report, child_command(op, path, shapes, per_bucket), launch_count)
    ok, output = _run(cmd, timeout_s)
    if not ok or not report.with_suffix(".ncu-rep").is_file():
        return {"message": f"ncu did not profile the candidate: {output[-1500:]}"}
    ok, text = _run(import_command(ncu, report.with_suffix(".ncu-rep")), 300)
    if not ok:
        return {"message": f"reading the ncu report failed: {text[-1500:]}"}
    kernels = parse_csv(text)
    if not kernels:
        return {"message": f"ncu profiled no kernel inside the range {RANGE!r}: "
                           f"{output[-800:]}"}
    return {"kernels": kernels, "ceiling_gb_s": _ceiling_gb_s(device), "ncu": ncu_version(ncu),
            "launch_count": launch_count, "command": " ".join(cmd), "csv": text}


def _run(cmd: list[str], timeout_s: float) -> tuple[bool, str]:
    from autoopt.profiler.nsight import _child_env

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_child_env(), start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return False, f"timed out after {timeout_s:.0f} s"
    return proc.returncode == 0, out


def _ceiling_gb_s(device: str) -> float | None:
    from autoopt.eval.timing import measure_ceilings

    c = measure_ceilings(device)
    return c.copy_bytes_s / 1e9 if c.meaningful else None


# ---- reading ncu's CSV ----------------------------------------------------------------------
def _value(text: str, unit: str) -> float | str | None:
    text = (text or "").strip()
    if text in ("", "n/a"):
        return None
    try:
        v = float(text.replace(",", ""))
    except ValueError:
        return text
    return v * _UNITS.get(unit.strip().lower(), 1.0)


def parse_csv(text: str) -> list[dict]:
    """Kernels from `ncu --csv` (raw page, wide, or details page, long), in launch order."""
    lines = [ln for ln in text.splitlines() if not ln.startswith("==")]
    head = next((i for i, ln in enumerate(lines) if ln.startswith('"ID"')), None)
    if head is None:
        return []
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[head:]))))
    if not rows:
        return []
    wanted = {v: k for k, v in METRICS.items()}
    nvtx = next((c for c in rows[0] if "Push/Pop_Range" in c or c.startswith("NVTX")), None)
    kernels: dict[str, dict] = {}
    if "Metric Name" in rows[0]:
        for r in rows:
            k = kernels.setdefault(r["ID"], _kernel(r, nvtx))
            name = wanted.get(r["Metric Name"])
            if name:
                k["raw"][name] = _value(r["Metric Value"], r.get("Metric Unit", ""))
    else:
        units = rows[0] if not rows[0].get("ID") else {}
        for r in rows:
            if not r.get("ID"):
                continue
            k = kernels.setdefault(r["ID"], _kernel(r, nvtx))
            for metric, name in wanted.items():
                if metric in r:
                    k["raw"][name] = _value(r[metric], units.get(metric, ""))
    return [_summary(kernels[i]) for i in sorted(kernels, key=lambda s: int(float(s)))]


def _kernel(r: dict, nvtx: str | None) -> dict:
    m = _BUCKET.findall(r.get(nvtx, "") if nvtx else "")
    return {"id": int(float(r["ID"])), "name": r.get("Kernel Name", "?"),
            "bucket": m[-1] if m else None, "raw": {}}


def _summary(k: dict) -> dict:
    raw: dict[str, Any] = k.pop("raw")
    num = {n: v for n, v in raw.items() if isinstance(v, float)}
    dram = (num["dram_read"] + num["dram_write"]) if {"dram_read", "dram_write"} <= set(num) \
        else None
    dur = num.get("duration_ns")
    stalls = sorted(((n.removeprefix("stall_"), v) for n, v in num.items()
                     if n.startswith("stall_")), key=lambda kv: -kv[1])
    smem = None
    if "smem_static" in num or "smem_dynamic" in num:
        smem = int(num.get("smem_static", 0) + num.get("smem_dynamic", 0))
    return {**k, "duration_us": dur / 1e3 if dur is not None else None,
            "dram_bytes": int(dram) if dram is not None else None,
            "dram_read_bytes": _int(num.get("dram_read")),
            "dram_write_bytes": _int(num.get("dram_write")),
            "dram_gb_s": dram / dur if dram is not None and dur else None,
            "dram_pct_of_peak": num.get("dram_pct_peak"),
            "occupancy_pct": num.get("occupancy_pct"), "registers": _int(num.get("registers")),
            "smem_per_block": smem, "block": _int(num.get("block")),
            "grid": _int(num.get("grid")), "l2_hit_pct": num.get("l2_hit_pct"),
            "stalls": [{"reason": r, "cycles_per_issue": v} for r, v in stalls[:3] if v > 0]}


def _int(v: float | None) -> int | None:
    return None if v is None else int(round(v))


def _f(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_profile(res: dict) -> str:
    """The tool result text: one block per kernel."""
    if "message" in res:
        return res["message"]
    ceiling = res.get("ceiling_gb_s")
    lines = [f"Nsight Compute {res.get('ncu')}: {len(res['kernels'])} kernel launch(es) of your "
             f"last verified submission (at most {res.get('launch_count')}); measured copy "
             f"ceiling {_f(ceiling, '.0f')} GB/s"]
    for k in res["kernels"]:
        share = (100.0 * k["dram_gb_s"] / ceiling if k.get("dram_gb_s") and ceiling else None)
        stalls = ", ".join(f"{s['reason']} {s['cycles_per_issue']:.2f}" for s in k["stalls"])
        lines += [f"- {k['name'][:90]} [{k.get('bucket') or '?'}]: {_f(k['duration_us'], '.2f')}"
                  f" us, grid {k['grid']} x block {k['block']}",
                  f"  DRAM {_f(k['dram_bytes'], ',')} B (read {_f(k['dram_read_bytes'], ',')}, "
                  f"write {_f(k['dram_write_bytes'], ',')}), {_f(k['dram_gb_s'], '.0f')} GB/s = "
                  f"{_f(share, '.0f')}% of the measured ceiling "
                  f"({_f(k['dram_pct_of_peak'], '.0f')}% of ncu's peak)",
                  f"  occupancy {_f(k['occupancy_pct'], '.1f')}% achieved, {k['registers']} "
                  f"registers/thread, {_f(k['smem_per_block'], ',')} B shared/block, L2 hit "
                  f"{_f(k['l2_hit_pct'], '.1f')}%",
                  f"  top stalls (cycles per issued instruction): {stalls or '-'}"]
    return "\n".join(lines)


# ---- the profiled child -----------------------------------------------------------------------
def _child(argv: list[str] | None = None) -> None:
    import argparse

    import torch

    from autoopt.eval.candidates import load_variant
    from model.ops import contract

    ap = argparse.ArgumentParser(description="Call a candidate once per shape inside the NVTX "
                                             f"range {RANGE} (run under ncu).")
    ap.add_argument("--op", required=True)
    ap.add_argument("--source", required=True)
    ap.add_argument("--shapes", required=True)
    ap.add_argument("--configs", default="{}")
    a = ap.parse_args(argv)
    c = contract(a.op)
    variant = load_variant(Path(a.source))
    per_bucket = json.loads(a.configs)
    shapes = json.loads(a.shapes)
    calls = []
    for k, s in enumerate(shapes):
        cfg = per_bucket.get(f"T={int(s['T'])}")
        args = c.make_inputs(dict(s), 1000 + k, "cuda")
        calls.append((f"T={int(s['T'])}", args, cfg))
        variant.run(*args, config=cfg)  # compile outside the range
    torch.cuda.synchronize()
    for label, args, cfg in calls:
        torch.cuda.nvtx.range_push(RANGE)
        torch.cuda.nvtx.range_push(label)
        variant.run(*args, config=cfg)
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        torch.cuda.nvtx.range_pop()


if __name__ == "__main__":
    _child()
