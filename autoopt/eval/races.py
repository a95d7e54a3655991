"""Races on the GPU: compute-sanitizer's racecheck on a small shape before a kernel is accepted.

racecheck reports shared-memory hazards (Triton's reductions and layout conversions, CuTe's
explicit shared memory). The candidate runs in a worker started under `compute-sanitizer --tool
racecheck`, at the plan's smallest bucket shape with T >= 2, a few calls; the log's RACECHECK
SUMMARY decides. Races between programs on global memory are not in racecheck's reach: on a GPU
they show as nondeterminism or wrong outputs over the verification's many calls, and on CPU the
interpreter runs the programs in shuffled orders (worker.py).
"""

from __future__ import annotations

import ast
import os
import re
import shutil
from pathlib import Path
from typing import Any

SANITIZER_TIMEOUT_S = 600.0
_SUMMARY = re.compile(r"RACECHECK SUMMARY:\s*(\d+)\s+hazards?\s+displayed\s*"
                      r"\((\d+)\s+errors?,\s*(\d+)\s+warnings?\)")


def is_kernel_language(text: bytes) -> bool:
    """Whether the variant launches its own kernels (imports triton or cutlass)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return False
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if any(n.split(".")[0] in ("triton", "cutlass") for n in names):
            return True
    return False


def sanitizer_path() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and (p := Path(root) / "bin" / "compute-sanitizer").is_file():
            return str(p)
    return None


def parse_summary(log: str) -> dict[str, Any]:
    """{'hazards', 'errors', 'warnings'} from a racecheck log, or {} when it has no summary."""
    found = list(_SUMMARY.finditer(log))
    if not found:
        return {}
    m = found[-1]
    return {"hazards": int(m.group(1)), "errors": int(m.group(2)), "warnings": int(m.group(3))}


def _close_and_read(w: Any, log: Path) -> str:
    """Stop the sanitized worker cleanly (the sanitizer writes its summary at exit), read the
    log before the worker's directory goes."""
    if w.proc is not None and w.proc.poll() is None:
        try:
            w.request({"cmd": "exit", "clean": True}, timeout=120)
            w.proc.wait(timeout=120)
        except Exception:  # noqa: BLE001 - the log says what happened
            pass
    return log.read_text(errors="replace") if log.is_file() else ""


def gpu_racecheck(c: Any, text: bytes, plan: Any, secret: Any, config: dict | None,
                  device: str, timeout_s: float | None = None) -> dict[str, Any]:
    from .channel import Worker, WorkerError
    from .run import POISON_DTYPES, palette_bits, start_candidate
    from .trials import Judge

    exe = sanitizer_path()
    if exe is None:
        return {"status": "not checked", "reason": "races: compute-sanitizer not found (install "
                "the CUDA toolkit, or verify with racecheck=False and say so)"}
    shape = min([s for s in plan.buckets if s.get("T", 0) >= 2] or plan.buckets,
                key=lambda s: c.cost(s).bytes)
    out: dict[str, Any] = {"tool": "compute-sanitizer --tool racecheck", "shape": shape}
    # The verification's own limit bounds this worker too (it is its slowest: every kernel runs
    # under the sanitizer), never more than SANITIZER_TIMEOUT_S.
    limit = SANITIZER_TIMEOUT_S if timeout_s is None else min(SANITIZER_TIMEOUT_S, timeout_s)
    w = Worker(device, budget_s=limit, wrapper=[])
    log = w.tmp / "racecheck.log"
    w.wrapper = [exe, "--tool", "racecheck", "--print-limit", "20", "--log-file", str(log)]
    try:
        w.start()
        palettes = {dt: secret.palette(dt) for dt in POISON_DTYPES}
        err = start_candidate(w, text, device, config, palettes, secret.seed())
        if err:
            return {**out, "status": "not checked", "reason": f"races: {err}"}
        j = Judge(c, w, device, palette_bits(palettes))
        for _ in range(2):
            case = j.make_case(shape, secret.seed())
            if case is not None:
                j.first_call(case)
        log_text = _close_and_read(w, log)
    except WorkerError as e:
        log_text = _close_and_read(w, log)
        return {**out, "status": "not checked", "log_tail": log_text[-1500:],
                "reason": f"races: the racecheck run failed: {e}"}
    finally:
        w.close()
    summary = parse_summary(log_text)
    out.update(summary=summary, log_tail=log_text[-1500:])
    if not summary:
        return {**out, "status": "not checked",
                "reason": "races: compute-sanitizer wrote no RACECHECK SUMMARY"}
    if summary["errors"]:
        first = next((ln for ln in log_text.splitlines() if "hazard" in ln.lower()), "")
        return {**out, "status": "races found",
                "reason": f"races: compute-sanitizer racecheck found {summary['hazards']} "
                          f"hazards ({summary['errors']} errors) at {shape}: {first.strip()}"}
    return {**out, "status": "passed"}
