"""The worker's audit hook: refuses side effects that the candidate's own code asks for.

`install(candidate_file, read_roots)` adds a hook with `sys.addaudithook` (a hook cannot be
removed) and returns a function that lists what it blocked. Its state (the candidate's path, the
blocked list, a re-entrancy flag) lives only in the hook's closure: there is no module global a
candidate could clear, and the static screen refuses every way to reach a closure (dunders,
frames, gc). The hook is never disarmed: the runner needs none of the refused events after the
candidate is loaded.

An event counts as the candidate's when the first frame outside the standard library that is on
the stack belongs to the candidate's file; work that torch or Triton do on its behalf (Triton
compiling and caching a kernel, reading its own sources) is theirs and allowed. Refused for the
candidate: processes, signals, sockets and URLs, ctypes, file writes and any file read outside
`read_roots` (imports read the installed packages; /proc, /dev and the repository are not
among them), imports outside the allowed modules, exec/compile of code that is not an installed
module's, frames, tracing, gc walks, other audit hooks and attribute writes on types.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from collections.abc import Callable, Iterable

_BLOCKED = (
    "subprocess.", "os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork", "os.forkpty",
    "os.kill", "os.killpg", "os.set", "os.chdir", "os.listdir", "os.scandir", "os.remove",
    "os.unlink", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate",
    "os.putenv", "os.unsetenv", "os.symlink", "os.link", "os.startfile", "pty.", "socket.",
    "ctypes.", "shutil.", "urllib.", "http.", "ftplib.", "smtplib.", "webbrowser.",
    "sys.settrace", "sys.setprofile", "sys.addaudithook", "sys._getframe",
    "sys._current_frames", "sys.setrecursionlimit", "gc.", "object.__setattr__",
    "object.__delattr__", "object.__getattr__", "function.__new__", "code.__new__",
    "marshal.", "pickle.", "cpython.", "sqlite3.", "mmap.", "resource.", "signal.",
    "_thread.", "syslog.", "fcntl.", "msvcrt.", "winreg.", "os.add_dll_directory",
)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def default_read_roots() -> tuple[str, ...]:
    """Where imports legitimately read from: the stdlib and the installed packages."""
    paths = sysconfig.get_paths()
    keys = ("stdlib", "platstdlib", "purelib", "platlib")
    return tuple(sorted({os.path.realpath(paths[k]) + os.sep for k in keys if paths.get(k)}))


def install(candidate_file: str, read_roots: Iterable[str],
            allowed_imports: Iterable[str]) -> Callable[[], list[str]]:
    """Add the hook for `candidate_file`; returns a function listing the blocked events."""
    candidate = os.path.realpath(candidate_file)
    roots = tuple(read_roots)
    imports = frozenset(allowed_imports)
    paths = sysconfig.get_paths()
    stdlib = tuple({p for p in (paths.get("stdlib"), paths.get("platstdlib")) if p})
    site = tuple({p for p in (paths.get("purelib"), paths.get("platlib")) if p})
    blocked: list[str] = []
    busy = [False]
    getframe = sys._getframe

    def origin() -> str | None:
        frame = getframe(2)
        while frame is not None:
            name = frame.f_code.co_filename
            if not (name.startswith("<") or (name.startswith(stdlib) and
                                              not name.startswith(site))):
                return name
            frame = frame.f_back
        return None

    def refused(event: str, args: tuple) -> bool:
        if event == "import":
            return str(args[0]).split(".")[0] not in imports
        if event == "open":
            return _writes(args) or not _inside(args[0], roots)
        if event in ("exec", "compile"):
            filename = args[1] if event == "compile" else getattr(args[0], "co_filename", "")
            return not _inside(filename, roots)
        return event.startswith(_BLOCKED)

    def hook(event: str, args: tuple) -> None:
        if busy[0]:
            return
        if not (event.startswith(_BLOCKED) or event in ("import", "open", "exec", "compile")):
            return
        busy[0] = True  # sys._getframe below raises its own audit event
        try:
            if origin() != candidate or not refused(event, args):
                return
            text = repr(args)
            blocked.append(f"{event} {text if len(text) < 120 else text[:117] + '...'}")
        finally:
            busy[0] = False
        raise PermissionError(f"sandbox: {event} is not allowed in a kernel variant")

    sys.addaudithook(hook)
    return lambda: list(blocked)


def _writes(args: tuple) -> bool:
    mode = args[1] if len(args) > 1 else None
    flags = args[2] if len(args) > 2 else 0
    if isinstance(mode, str) and any(c in mode for c in "wax+"):
        return True
    return isinstance(flags, int) and bool(flags & _WRITE_FLAGS)


def _inside(path: object, roots: tuple[str, ...]) -> bool:
    if isinstance(path, bytes):
        path = path.decode("utf-8", "replace")
    if not isinstance(path, str) or not path:
        return False
    return os.path.realpath(path).startswith(roots)
