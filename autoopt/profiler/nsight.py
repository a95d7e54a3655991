"""Nsight Compute over a bounded sample of a served step's kernels: durations and DRAM bytes.

Replaying every kernel of a 52-layer step takes minutes (8,561 kernels took 202 s on an H200),
so Nsight Compute sees only a sample: the kernels of the ops a profile found on top, at most
`launch_count` of them. The `ncu` CLI profiles a child process (`python -m
autoopt.profiler.child ...`) that builds the served step (same seed, so the same weights,
routing and kernels; the fewest layers that hold every layer kind) and runs one eager step in
which only the sampled ops' calls sit inside the NVTX range `autoopt_sample`
(`--nvtx-include`), with `--clock-control none` (leave the GPU's clocks alone) and
`--cache-control none` (caches as the real step finds them).

The report is read with Nsight Compute's own Python module (`ncu_report`, shipped in its
`extras/python`) and, failing that, from `ncu --import ... --csv`. Each kernel carries its NVTX
push/pop stack; the innermost op or region name labels it. Tested with ncu 2025.3.1; the
nsight-python package is not needed (0.9.x would also work with that ncu; 1.x refuses it).
"""

from __future__ import annotations

import csv
import glob
import importlib
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .. import env
from .attribution import KNOWN_RANGES, OTHER, KernelRecord, innermost

TIME = "gpu__time_duration.sum"
READ, WRITE = "dram__bytes_read.sum", "dram__bytes_write.sum"
METRICS = (TIME, READ, WRITE)
_UNITS = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
          "second": 1e6, "s": 1e6, "byte": 1.0, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9,
          "tbyte": 1e12, "": 1.0}
_KNOWN_RE = re.compile(r"(?<![\w])(" + "|".join(sorted(KNOWN_RANGES, key=len, reverse=True))
                       + r")(?![\w])")


class NcuError(RuntimeError):
    """Nsight Compute could not profile the step; the message says why."""


@dataclass(frozen=True)
class NcuRun:
    records: list[KernelRecord]
    version: str
    wall_s: float
    reader: str  # "ncu_report" | "csv"
    command: str


def find_ncu() -> str | None:
    """The ncu CLI: $AUTOOPT_NCU, then PATH, then CUDA's default install."""
    for cand in (env.ncu_path(), shutil.which("ncu"), "/usr/local/cuda/bin/ncu"):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    return None


def ncu_version(ncu: str) -> str:
    try:
        out = subprocess.run([ncu, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"
    match = re.search(r"Version\s+([0-9][0-9.]*)", out.stdout)
    if match:
        return match.group(1)
    return (out.stdout.strip().splitlines() or ["unknown"])[-1]


def _scale(unit: str) -> float:
    return _UNITS.get(unit.strip().lower(), 1.0)


def _number(text: str) -> float:
    return float(str(text).split(" (", 1)[0].replace(",", "") or 0.0)


# ---- reading a report ------------------------------------------------------------------------
def _ncu_report_module(ncu: str):
    try:
        return importlib.import_module("ncu_report")
    except ImportError:
        pass
    real = Path(ncu).resolve()
    dirs = [str(p / "extras" / "python") for p in real.parents[:3]]
    dirs += sorted(glob.glob("/opt/nvidia/nsight-compute/*/extras/python"), reverse=True)
    dirs += sorted(glob.glob("/usr/local/cuda*/nsight-compute*/extras/python"), reverse=True)
    for d in dirs:
        if Path(d, "ncu_report.py").is_file():
            sys.path.insert(0, d)
            try:
                return importlib.import_module("ncu_report")
            finally:
                sys.path.remove(d)
    raise ImportError(f"ncu_report not found next to {real} or in /opt/nvidia/nsight-compute")


def _metric(action, name: str) -> float | None:
    m = action.metric_by_name(name)
    if m is None:
        return None
    value = m.as_double() if hasattr(m, "as_double") else m.value()
    return None if value is None else float(value) * _scale(m.unit())


def read_with_ncu_report(report: Path, ncu: str) -> list[KernelRecord]:
    mod = _ncu_report_module(ncu)
    ctx = mod.load_report(str(report))
    records = []
    for r in range(ctx.num_ranges()):
        rng = ctx.range_by_idx(r)
        for a in range(rng.num_actions()):
            action = rng.action_by_idx(a)
            stack: list[str] = []
            state = action.nvtx_state()
            if state is not None:
                for d in state.domains():
                    stack += list(state.domain_by_id(d).push_pop_ranges())
            t = _metric(action, TIME)
            rd, wr = _metric(action, READ), _metric(action, WRITE)
            dram = int(rd + wr) if rd is not None and wr is not None else None
            records.append(KernelRecord(action.name(), innermost(stack), t or 0.0, dram))
    return records


def _child_env() -> dict[str, str]:
    """This environment with the repo first on PYTHONPATH (children import autoopt from it)."""
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join(
        [str(env.REPO_ROOT)] + ([child_env["PYTHONPATH"]] if child_env.get("PYTHONPATH") else []))
    return child_env


def read_in_child(report: Path, ncu: str, timeout_s: float = 600.0) -> list[KernelRecord]:
    """`read_with_ncu_report` in a child process: the ncu_report module is a native extension
    that has crashed a host process (a segfault inside pytest); a crash here is an error the
    caller can fall back from."""
    cmd = [sys.executable, "-m", "autoopt.profiler.nsight", "--read", str(report), "--ncu", ncu]
    child_env = _child_env()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=child_env)
    if proc.returncode:
        raise NcuError(f"the ncu_report reader exited {proc.returncode}: {proc.stderr[-800:]}")
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    return [KernelRecord(name, label, float(us), None if dram is None else int(dram))
            for name, label, us, dram in rows]


def _csv_label(cell: str) -> str:
    # The NVTX cell lists the push/pop stack outermost first; the last known name is innermost.
    hits = _KNOWN_RE.findall(cell or "")
    return hits[-1] if hits else OTHER


def parse_ncu_csv(text: str) -> list[KernelRecord]:
    """Kernels from `ncu --csv` output, long (one row per metric) or wide (one per kernel)."""
    lines = text.splitlines()
    head = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if head is None:
        raise NcuError("ncu CSV output has no header row starting with \"ID\"")
    rows = list(csv.DictReader(io.StringIO("\n".join(lines[head:]))))
    cols = list(rows[0]) if rows else []
    nvtx = next((c for c in cols if "Push/Pop_Range" in c), None)
    kernels: dict[str, dict] = {}
    if "Metric Name" in cols:
        for r in rows:
            k = kernels.setdefault(r["ID"], {"name": r.get("Kernel Name", "?"),
                                             "nvtx": r.get(nvtx, "") if nvtx else ""})
            k[r["Metric Name"]] = _number(r["Metric Value"]) * _scale(r.get("Metric Unit", ""))
    else:
        units = rows[0] if rows and not rows[0].get("ID") else {}
        for r in rows:
            if not r.get("ID"):
                continue
            k = kernels.setdefault(r["ID"], {"name": r.get("Kernel Name", "?"),
                                             "nvtx": r.get(nvtx, "") if nvtx else ""})
            for m in METRICS:
                if r.get(m) not in (None, ""):
                    k[m] = _number(r[m]) * _scale(units.get(m, ""))
    out = []
    for kid in sorted(kernels, key=lambda s: int(_number(s))):
        k = kernels[kid]
        dram = int(k[READ] + k[WRITE]) if READ in k and WRITE in k else None
        out.append(KernelRecord(k["name"], _csv_label(k["nvtx"]), k.get(TIME, 0.0), dram))
    return out


def read_with_csv(report: Path, ncu: str) -> list[KernelRecord]:
    cmd = [ncu, "--import", str(report), "--csv", "--page", "details", "--print-units", "base"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise NcuError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr[-2000:]}")
    return parse_ncu_csv(out.stdout)


# ---- running ---------------------------------------------------------------------------------
SAMPLE_RANGE = "autoopt_sample"


def child_command(target: str, batch: int, layers: int, context: int, kernels: str,
                  seed: int, registry: str | None = None, ops: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "autoopt.profiler.child", "--target", target, "--batch",
            str(batch), "--layers", str(layers), "--context", str(context), "--kernels", kernels,
            "--seed", str(seed)] + (["--registry", str(registry)] if registry else []) + \
        (["--ops", ",".join(ops)] if ops else [])


def run_ncu(target: str, batch: int, layers: int, context: int, kernels: str = "reference",
            seed: int = 0, out_dir: Path | None = None, timeout_s: float = 600.0,
            registry: str | None = None, ops: tuple[str, ...] = (),
            launch_count: int | None = None) -> NcuRun:
    """Profile the sampled ops' kernels (every op's when `ops` is empty) of one step of the
    target under ncu in a child process; raise NcuError on failure."""
    ncu = find_ncu()
    if ncu is None:
        raise NcuError("ncu (Nsight Compute CLI) not found on PATH or in /usr/local/cuda/bin; "
                       "set AUTOOPT_NCU or use --backend torch")
    out_dir = Path(out_dir or env.cache_dir() / "ncu")
    out_dir.mkdir(parents=True, exist_ok=True)
    base = out_dir / f"{Path(target).stem}-b{batch}-l{layers}"
    cmd = [ncu, "--nvtx", "--nvtx-include", f"{SAMPLE_RANGE}/", "--clock-control", "none",
           "--cache-control", "none", "--metrics", ",".join(METRICS), "--target-processes", "all",
           "-f", "-o", str(base)]
    if launch_count:
        cmd += ["--launch-count", str(launch_count)]
    cmd += child_command(target, batch, layers, context, kernels, seed, registry, ops)
    child_env = _child_env()
    start = time.perf_counter()
    # Its own session, so a timeout ends ncu and the profiled child (which holds the model's
    # GPU memory) together.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=child_env, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise NcuError(f"ncu did not finish within {timeout_s:.0f} s; sample fewer kernels "
                       "(--ncu-sample) or fewer --layers") from None
    wall = time.perf_counter() - start
    report = base.with_suffix(".ncu-rep")
    if proc.returncode or not report.is_file():
        raise NcuError(f"ncu exited {proc.returncode} without a report: {output[-3000:]}")
    version = ncu_version(ncu)
    try:
        records, reader = read_in_child(report, ncu), "ncu_report"
    except Exception as first:  # noqa: BLE001 - any reader failure falls back to the CSV export
        try:
            records, reader = read_with_csv(report, ncu), f"csv (ncu_report: {first})"
        except Exception as second:  # noqa: BLE001
            raise NcuError(f"cannot read {report}: ncu_report: {first}; csv: {second}") from None
    if not records:
        raise NcuError(f"ncu profiled no kernel inside the NVTX range {SAMPLE_RANGE!r}; "
                       f"its output ended: {output[-1500:]}")
    return NcuRun(records, version, wall, reader, " ".join(cmd))


def sample_layers(target) -> int:
    """The fewest layers that hold every layer kind (dense/MoE MLP, sliding/full attention)."""
    return target.kind_layers()


def sample_top_kernels(p, launch_count: int, registry=None, timeout_s: float = 300.0):
    """`p` with an Nsight Compute sample of its top ops' kernels in `checks["ncu_sample"]`:
    per kernel, its op, duration and measured DRAM bytes (or why there is none). Each of the
    top three ops gets its own ncu run and an equal share of `launch_count` and `timeout_s`:
    one run over all three profiled only the first op of a layer's kernels (attention's first
    sixteen gathers and masks on an H200, none of the MoE's)."""
    import dataclasses

    from ..targets import load_target

    ops = tuple(r.op for r in p.ranked()[:3])
    target = load_target(p.target)
    layers = min(p.layers, sample_layers(target))
    share = max(1, launch_count // max(len(ops), 1))
    kernels, errors, walls, readers, version = [], {}, 0.0, set(), None
    for op in ops:
        try:
            run = run_ncu(str(target.source or target.name), p.batch, layers, p.context,
                          p.kernels, int(p.checks.get("seed", 0)),
                          timeout_s=timeout_s / len(ops),
                          registry=str(registry) if registry else None, ops=(op,),
                          launch_count=share)
        except NcuError as e:
            errors[op] = str(e)
            continue
        version, walls = run.version, walls + run.wall_s
        readers.add(run.reader)
        kernels += [{"name": r.name, "op": r.op, "us": r.duration_us,
                     "dram_bytes": r.dram_bytes,
                     "gb_s": (r.dram_bytes / r.duration_us / 1e3
                              if r.dram_bytes and r.duration_us else None)}
                    for r in run.records]
    if ops and len(errors) == len(ops):
        sample = {"ops": list(ops), "error": "; ".join(sorted(set(errors.values())))}
    else:
        sample = {"ops": list(ops), "layers": layers, "ncu": version, "wall_s": walls,
                  "reader": "; ".join(sorted(readers)), "per_op": share, "kernels": kernels}
        if errors:
            sample["errors"] = errors
    return dataclasses.replace(p, checks={**p.checks, "ncu_sample": sample})


if __name__ == "__main__":  # the child of `read_in_child`: one JSON line of kernel records
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--read", required=True)
    ap.add_argument("--ncu", required=True)
    a = ap.parse_args()
    recs = read_with_ncu_report(Path(a.read), a.ncu)
    print(json.dumps([[r.name, r.op, r.duration_us, r.dram_bytes] for r in recs]))
