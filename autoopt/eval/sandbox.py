"""Run a harness job on a candidate in a child process with a timeout.

The parent writes the job (name + JSON params) to a private temporary directory and starts
`python -m autoopt.eval.sandbox <dir>` in its own session, with the candidate's secrets stripped
from the environment, the temporary directory as working directory and, on CPU, the Triton
interpreter on and glibc's MALLOC_PERTURB_ set (fresh and freed memory hold poison bytes). A
child that runs past the timeout is killed with its whole process group. The child writes its
result as JSON; a crash, a kill or a missing result becomes a `ChildResult` with the reason.

Inside the child, `arm(candidate_file)` installs an audit hook (`sys.addaudithook`, which cannot
be removed) as defense in depth behind the static screen: process spawning, sockets, file opens,
file-system changes, ctypes and imports outside the allow-list are refused when the first
non-standard-library frame that asked for them is the candidate's own code. Work that torch or
Triton do on the candidate's behalf (Triton compiling and caching a kernel) is allowed.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autoopt.env import REPO_ROOT

# Job name -> "module:function" run in the child with the params dict; returns a JSON dict.
JOBS = {
    "verify": "autoopt.eval.verify:verify_job",
    "bench": "autoopt.eval.timing:bench_job",
    "echo": "autoopt.eval.sandbox:_echo_job",
}
_SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "CREDENTIAL")
_TAIL = 4000


@dataclass
class ChildResult:
    ok: bool
    result: dict | None
    error: str | None = None
    timed_out: bool = False
    returncode: int | None = None
    elapsed_s: float = 0.0
    stderr_tail: str = ""
    stdout_tail: str = ""
    blocked: list[str] = field(default_factory=list)


def child_env(device: str, *, perturb: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not any(w in k.upper() for w in _SECRET_WORDS)}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if not device.startswith("cuda"):
        # CPU tensors can only run Triton kernels through the interpreter.
        env["TRITON_INTERPRET"] = "1"
        # Small CPU shapes: intra-op threads only contend (a 2-core runner got 500x slower sums).
        env["OMP_NUM_THREADS"] = "1"
        if perturb:
            from .guards import MALLOC_PERTURB

            env["MALLOC_PERTURB_"] = MALLOC_PERTURB
    return env


def run_child(job: str, params: dict, *, timeout_s: float, device: str = "cpu",
              perturb: bool = True, mem_limit_bytes: int | None = None) -> ChildResult:
    """Run `job` with `params` in a fresh child process; never raises for the child's faults."""
    if job not in JOBS:
        raise ValueError(f"unknown sandbox job {job!r}; known: {', '.join(JOBS)}")
    with tempfile.TemporaryDirectory(prefix="autoopt-sandbox-") as tmp:
        work = Path(tmp)
        task = {"job": job, "params": params, "mem_limit_bytes": mem_limit_bytes}
        (work / "task.json").write_text(json.dumps(task))
        start = time.monotonic()
        with open(work / "stdout.txt", "wb") as out, open(work / "stderr.txt", "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "autoopt.eval.sandbox", str(work)],
                cwd=work, env=child_env(device, perturb=perturb), stdout=out, stderr=err,
                stdin=subprocess.DEVNULL, start_new_session=True)
            timed_out = False
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc)
        elapsed = time.monotonic() - start
        res = ChildResult(ok=False, result=None, timed_out=timed_out,
                          returncode=proc.returncode, elapsed_s=elapsed,
                          stderr_tail=_tail(work / "stderr.txt"),
                          stdout_tail=_tail(work / "stdout.txt"))
        if timed_out:
            res.error = f"timeout after {timeout_s:g} s (child killed)"
            return res
        result_file = work / "result.json"
        if not result_file.is_file():
            res.error = (f"child exited with code {proc.returncode} without a result "
                         f"(crash or os._exit); stderr: {res.stderr_tail[-500:]}")
            return res
        payload = json.loads(result_file.read_text())
        res.ok = payload.get("ok", False)
        res.result = payload.get("result")
        res.error = payload.get("error")
        res.blocked = payload.get("blocked", [])
        return res


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the child leads its own session: pgid == pid
    except ProcessLookupError:
        pass
    proc.wait()


def _tail(path: Path) -> str:
    try:
        return path.read_bytes()[-_TAIL:].decode("utf-8", "replace")
    except OSError:
        return ""


# ---- child side ------------------------------------------------------------------------------

_STATE: dict[str, Any] = {"armed": None, "blocked": [], "busy": False}
_PATHS = sysconfig.get_paths()
_STDLIB = tuple({p for p in (_PATHS.get("stdlib"), _PATHS.get("platstdlib")) if p})
# site-packages may sit inside the stdlib directory (conda): torch and triton are not stdlib.
_SITE = tuple({p for p in (_PATHS.get("purelib"), _PATHS.get("platlib")) if p})
_BLOCKED_EVENTS = ("subprocess.", "os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork",
                   "os.forkpty", "os.kill", "os.killpg", "pty.", "socket.", "ctypes.", "shutil.",
                   "os.remove", "os.unlink", "os.rename", "os.rmdir", "os.mkdir", "os.chmod",
                   "os.truncate", "os.putenv", "os.unsetenv", "urllib.", "http.", "ftplib.",
                   "smtplib.", "webbrowser.", "sys.settrace", "sys.setprofile",
                   "sys.addaudithook", "gc.get_referrers", "gc.get_objects", "open")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def arm(candidate_file: str | Path) -> None:
    """Start refusing candidate-originated side effects (the hook is installed once)."""
    path = str(Path(candidate_file).resolve())
    if _STATE["armed"] is None and not _STATE.get("installed"):
        sys.addaudithook(_audit)
        _STATE["installed"] = True
    _STATE["armed"] = path


def blocked_events() -> list[str]:
    return list(_STATE["blocked"])


def _audit(event: str, args: tuple) -> None:
    armed = _STATE["armed"]
    if armed is None or _STATE["busy"]:
        return
    if not event.startswith(_BLOCKED_EVENTS) and event != "import":
        return
    _STATE["busy"] = True  # sys._getframe below raises its own audit event
    try:
        origin = _first_non_stdlib_file()
        if origin != armed:
            return
        if event == "import" and _import_allowed(str(args[0])):
            return
        if event == "open" and not _writes(args):
            return  # imports read source files on the candidate's behalf
        desc = f"{event} {_short(args)}"
        _STATE["blocked"].append(desc)
    finally:
        _STATE["busy"] = False
    raise PermissionError(f"sandbox: {event} is not allowed in a kernel variant")


def _writes(args: tuple) -> bool:
    mode = args[1] if len(args) > 1 else None
    flags = args[2] if len(args) > 2 else 0
    if isinstance(mode, str) and any(c in mode for c in "wax+"):
        return True
    return isinstance(flags, int) and bool(flags & _WRITE_FLAGS)


def _import_allowed(module: str) -> bool:
    from .guards import ALLOWED_IMPORTS

    return module.split(".")[0] in ALLOWED_IMPORTS


def _first_non_stdlib_file() -> str | None:
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        stdlib = name.startswith(_STDLIB) and not name.startswith(_SITE)
        if not (name.startswith("<") or stdlib):
            return name
        frame = frame.f_back
    return None


def _short(args: tuple) -> str:
    text = repr(args)
    return text if len(text) < 120 else text[:117] + "..."


def _echo_job(params: dict) -> dict:
    """A job for testing the sandbox itself: optionally load and call a variant."""
    out: dict[str, Any] = {"params": params}
    out["env"] = {k: os.environ.get(k) for k in ("TRITON_INTERPRET", "MALLOC_PERTURB_",
                                                 "OMP_NUM_THREADS")}
    out["secret_keys"] = sorted(k for k in os.environ
                                if any(w in k.upper() for w in _SECRET_WORDS))
    if params.get("source"):
        from .candidates import load_variant

        arm(params["source"])
        try:
            variant = load_variant(Path(params["source"]))
            out["returned"] = repr(variant.run())
        except Exception as e:  # the candidate's fault: reported, not raised
            out["raised"] = f"{type(e).__name__}: {e}"
    out["blocked"] = blocked_events()
    return out


def _set_limits(mem_limit_bytes: int | None) -> None:
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if mem_limit_bytes:
            resource.setrlimit(resource.RLIMIT_AS, (mem_limit_bytes, mem_limit_bytes))
    except (ImportError, ValueError, OSError):  # pragma: no cover - platform without limits
        pass


def main(argv: list[str] | None = None) -> int:
    work = Path((argv or sys.argv[1:])[0])
    task = json.loads((work / "task.json").read_text())
    _set_limits(task.get("mem_limit_bytes"))
    payload: dict[str, Any]
    try:
        module_name, func_name = JOBS[task["job"]].split(":")
        module = importlib.import_module(module_name)
        result = getattr(module, func_name)(task["params"])
        payload = {"ok": True, "result": result}
    except BaseException as e:  # noqa: BLE001 - everything becomes a reported failure
        payload = {"ok": False, "result": None,
                   "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"}
    payload["blocked"] = blocked_events()
    _STATE["armed"] = None  # the harness writes the result, whatever the candidate did
    (work / "result.json").write_text(json.dumps(payload, default=str))
    sys.stdout.flush()
    # Skip interpreter teardown: a candidate's atexit/finalizers must not run or hang.
    os._exit(0)


if __name__ == "__main__":
    # Run the package's module object, not this `__main__` copy: the jobs import
    # autoopt.eval.sandbox, and the audit state must be one and the same.
    from autoopt.eval import sandbox as _sandbox

    _sandbox.main()
