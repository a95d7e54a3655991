"""Races on the GPU: compute-sanitizer's racecheck on a small shape before a kernel is accepted;
and, on request, its memcheck for accesses out of bounds.

racecheck reports shared-memory hazards (Triton's reductions and layout conversions, CuTe's
explicit shared memory). The candidate runs in a worker started under `compute-sanitizer --tool
racecheck`, at the plan's smallest bucket shape and its smallest with T >= 2 (a variant may take
another path per token count), a few calls each; the log decides. A hazard counts against the
candidate unless every kernel its record names is a library's: a kernel whose symbol contains
no function name the candidate's source defines, as a whole word (Triton names a kernel after
its function, CuTe DSL puts the function's name inside the symbol; the screen forbids renaming
one). cuBLAS's split-K GEMMs report hazards of their own when a variant calls the library, as
the reference does: on an H200, `nvjet_sm90_tst_64x8_64x16_4x1_v_bz_splitK_TNT` at T = 8. A
record that names no kernel, and records the log's print limit left out, count against it.
Races between programs on global memory are not in racecheck's reach: on a GPU they show as
nondeterminism or wrong outputs over the verification's many calls, and on CPU the interpreter
runs the programs in shuffled orders (worker.py).
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
_ERRORS = re.compile(r"ERROR SUMMARY:\s*(\d+)\s+errors?")
_INVALID = re.compile(r"Invalid __\w+__ (?:read|write)")
_RECORD = re.compile(r"(Error|Warning): Race reported between")
_KERNEL = re.compile(r"access at\s+(?:0x[0-9a-fA-F]+\s+in\s+([^\s\[]+)|([^\s\[+]+)\+0x)")


def defined_names(text: bytes) -> set[str]:
    """The function names a candidate's source defines (its kernels' symbols contain them)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return set()
    return {n.name for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def hazard_records(log: str) -> list[dict[str, Any]]:
    """Each displayed racecheck record: its kind (error or warning) and the kernels it names."""
    records: list[dict[str, Any]] = []
    for line in log.splitlines():
        m = _RECORD.search(line)
        if m:
            records.append({"kind": m.group(1).lower(), "kernels": []})
        if records and "access at" in line:
            records[-1]["kernels"] += [a or b for a, b in _KERNEL.findall(line)]
    return records


def candidate_errors(log: str, summary: dict[str, Any], names: set[str]) -> tuple[int, list]:
    """(error records that count against the candidate, kernels of the library-only ones)."""
    errors = [r for r in hazard_records(log) if r["kind"] == "error"]
    own = [re.compile(rf"(?<![A-Za-z0-9]){re.escape(n)}(?![A-Za-z0-9])") for n in names]
    library = [r for r in errors if r["kernels"] and not any(
        p.search(k) for k in r["kernels"] for p in own)]
    total = summary.get("errors", 0)  # the summary's count decides; records only attribute it
    unseen = max(0, total - len(errors))  # past the print limit
    kernels = sorted({k for r in library for k in r["kernels"]})
    return min(total, len(errors) - len(library) + unseen), kernels


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


def _sanitized_calls(tool: str, flags: list[str], env: dict[str, str], label: str, c: Any,
                     text: bytes, plan: Any, secret: Any, config: dict | None, device: str,
                     timeout_s: float | None, drawn: bool = False
                     ) -> tuple[dict[str, Any], str | None]:
    """The candidate in a worker under `compute-sanitizer --tool TOOL`, two calls at the plan's
    smallest bucket, at its smallest with T >= 2 and (`drawn`) at its smallest drawn shape: (what
    to report, the sanitizer's log), the log None when the run could not be made (the report
    then says why, under "reason")."""
    from .channel import Worker, WorkerError
    from .run import POISON_DTYPES, palette_bits, start_candidate
    from .trials import Judge

    exe = sanitizer_path()
    if exe is None:
        return {"status": "not checked", "reason": f"{label}: compute-sanitizer not found "
                "(install the CUDA toolkit, or verify without it and say so)"}, None
    def smallest(shapes):
        return min(shapes, key=lambda s: c.cost(s).bytes)

    shapes = [smallest(plan.buckets)]
    rows = [s for s in plan.buckets if s.get("T", 0) >= 2]
    if rows and smallest(rows) != shapes[0]:
        shapes.append(smallest(rows))
    if drawn and plan.drawn and smallest(plan.drawn) not in shapes:
        shapes.append(smallest(plan.drawn))
    out: dict[str, Any] = {"tool": f"compute-sanitizer --tool {tool}",
                           "shape": shapes[-1], "shapes": shapes}
    # The verification's own limit bounds this worker too (it is its slowest: every kernel runs
    # under the sanitizer), never more than SANITIZER_TIMEOUT_S.
    limit = SANITIZER_TIMEOUT_S if timeout_s is None else min(SANITIZER_TIMEOUT_S, timeout_s)
    w = Worker(device, budget_s=limit, wrapper=[], env=env)
    log = w.tmp / f"{tool}.log"
    w.wrapper = [exe, "--tool", tool, *flags, "--print-limit", "20", "--log-file", str(log)]
    try:
        w.start()
        palettes = {dt: secret.palette(dt) for dt in POISON_DTYPES}
        err = start_candidate(w, text, device, config, palettes, secret.seed())
        if err:
            return {**out, "status": "not checked", "reason": f"{label}: {err}"}, None
        j = Judge(c, w, device, palette_bits(palettes))
        for shape in shapes:
            for _ in range(2):
                case = j.make_case(shape, secret.seed())
                if case is not None:
                    j.first_call(case)
        log_text = _close_and_read(w, log)
    except WorkerError as e:
        log_text = _close_and_read(w, log)
        return {**out, "status": "not checked", "log_tail": log_text[-1500:],
                "reason": f"{label}: the {tool} run failed: {e}"}, None
    finally:
        w.close()
    out["log_tail"] = log_text[-1500:]
    return out, log_text


def gpu_racecheck(c: Any, text: bytes, plan: Any, secret: Any, config: dict | None,
                  device: str, timeout_s: float | None = None) -> dict[str, Any]:
    out, log_text = _sanitized_calls("racecheck", [], {}, "races", c, text, plan, secret, config,
                                     device, timeout_s)
    if log_text is None:
        return out
    summary = parse_summary(log_text)
    out["summary"] = summary
    if not summary:
        return {**out, "status": "not checked",
                "reason": "races: compute-sanitizer wrote no RACECHECK SUMMARY"}
    counted, library = candidate_errors(log_text, summary, defined_names(text))
    if library:
        out["library_hazards"] = library  # hazards inside library kernels the variant calls
    if counted:
        first = next((ln for ln in log_text.splitlines() if "hazard" in ln.lower()), "")
        return {**out, "status": "races found",
                "reason": f"races: compute-sanitizer racecheck found {summary['hazards']} "
                          f"hazards ({summary['errors']} errors, {counted} in the candidate's "
                          f"kernels or unattributed) at {out['shapes']}: {first.strip()}"}
    return {**out, "status": "passed"}


def parse_memcheck(log: str) -> int | None:
    """Errors in a memcheck log's ERROR SUMMARY, or None when it has none."""
    found = list(_ERRORS.finditer(log))
    return int(found[-1].group(1)) if found else None


def gpu_memcheck(c: Any, text: bytes, plan: Any, secret: Any, config: dict | None,
                 device: str, timeout_s: float | None = None) -> dict[str, Any]:
    """The candidate under compute-sanitizer's memcheck, at the racecheck's shapes and the plan's
    smallest drawn one (a secret token count and, on a GPU, odd widths: a store that stays inside
    the allocator's 512-byte rounding has room there, where the target's widths may leave none),
    with torch's caching allocator off in the worker (PYTORCH_NO_CUDA_MEMORY_CACHING=1): every
    tensor is its own allocation, so a load or store past an input's or output's end is outside
    any allocation and reported, where with the cache it would land in the allocator's slack
    unseen. API errors that torch provokes and handles itself are not counted
    (--report-api-errors no)."""
    out, log_text = _sanitized_calls("memcheck", ["--report-api-errors", "no"],
                                     {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}, "memcheck", c,
                                     text, plan, secret, config, device, timeout_s, drawn=True)
    if log_text is None:
        # memcheck stops a kernel at its first invalid access, and the worker then fails with a
        # launch failure: what the sanitizer logged up to there is still the finding.
        tail = out.get("log_tail", "")
        errors = parse_memcheck(tail) or len(_INVALID.findall(tail))
        if errors:
            return {**out, "status": "errors found", "errors": errors,
                    "reason": f"memcheck: compute-sanitizer memcheck found {errors} errors at "
                              f"{out['shapes']} (the worker failed after them: "
                              f"{out['reason'].split(': ', 1)[-1][:200]})"}
        return out
    errors = parse_memcheck(log_text)
    out["errors"] = errors
    if errors is None:
        return {**out, "status": "not checked",
                "reason": "memcheck: compute-sanitizer wrote no ERROR SUMMARY"}
    if errors:
        first = next((ln for ln in log_text.splitlines()
                      if "Invalid" in ln or "out of bounds" in ln.lower()), "")
        return {**out, "status": "errors found",
                "reason": f"memcheck: compute-sanitizer memcheck found {errors} errors at "
                          f"{out['shapes']}: {first.strip()}"}
    return {**out, "status": "passed"}
