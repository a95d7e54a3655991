"""CuTe DSL (nvidia-cutlass-dsl) as a kernel language: load-and-compile cache and a compile check.

A CuTe variant file declares `LANGUAGE = "cute"` (and usually `ARCHS = ("sm_90",)`), exports
`run(...)` like every variant, and `precompile(arch) -> list[str]`: it compiles each kernel it
launches at representative shapes with fake tensors (`cute.runtime.make_fake_*`), so a machine
without a GPU can build the cubins. At run time on a GPU the variant compiles on first use per
static shape (`cute.compile`, memoised in the variant), exactly as the DSL does; this module
caches the loaded variant per (source sha256, arch), so a variant's bytes are executed once.

- `compile(module_source, sha, arch)`: the variant's `run`, from an in-process cache keyed by
  (sha, arch); refuses a source whose hash is not `sha` and an arch the DSL cannot target.
- `check_compiles(path, arch)`: errors (empty: fine) from compiling the file's kernels for `arch`
  in a child process with `CUTE_DSL_ARCH=<arch>` (the DSL reads it when it is imported, so a
  child keeps this process's DSL untouched; a crash in the compiler stays there too).
- `cute_variants(root)`: every `LANGUAGE = "cute"` variant under a registry directory.

The CPU path never imports cutlass: it is imported only inside the functions that compile.
`python -m model.registry.cute FILE [ARCH]` is the child's entry point (prints one JSON line).
"""

from __future__ import annotations

import builtins
import hashlib
import importlib.util
import json
import linecache
import os
import re
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path

from .languages import read_declarations
from .names import RegistryError

DIST = "nvidia-cutlass-dsl"
_ARCH = re.compile(r"^sm_(\d+)a?$")
_LOADED: dict[tuple[str, str], types.ModuleType] = {}


def unavailable() -> str | None:
    """Why CuTe DSL variants cannot be compiled here (None: the DSL is installed)."""
    if importlib.util.find_spec("cutlass") is None:
        return f"{DIST} is not installed (pip install {DIST}, or the test extra)"
    return None


def dsl_arch(arch: str) -> str:
    """The DSL's arch name for a registry arch: Hopper's WGMMA/TMA need the `a` target."""
    m = _ARCH.match(arch)
    if not m:
        raise ValueError(f"arch {arch!r} is not a CUDA arch like 'sm_90' or 'sm_90a'")
    return arch if arch.endswith("a") or int(m.group(1)) < 90 else arch + "a"


def declared_language(source: str) -> str | None:
    """The file's LANGUAGE (the registry's static read; None when the file is not valid)."""
    try:
        return read_declarations(source).language
    except RegistryError:
        return None


def cute_variants(root: str | Path) -> list[Path]:
    """Variant files `<op>/<name>.py` under `root` that declare LANGUAGE = "cute"."""
    return sorted(p for p in Path(root).glob("*/*.py")
                  if declared_language(p.read_text()) == "cute")


def _load(source: str, name: str) -> types.ModuleType:
    # The DSL reads each @cute.jit function's source (inspect): serve it from linecache.
    module = types.ModuleType(name)
    module.__file__ = f"<cute variant {name}>"
    linecache.cache[module.__file__] = (len(source), None, source.splitlines(True), module.__file__)
    exec(builtins.compile(source, module.__file__, "exec"), module.__dict__)  # noqa: S102
    return module


def compile(module_source: str, sha: str, arch: str) -> Callable:  # noqa: A001
    """The variant's `run`, its source executed once per (sha, arch) in this process."""
    digest = hashlib.sha256(module_source.encode()).hexdigest()
    if digest != sha:
        raise ValueError(f"CuTe variant source hashes to {digest[:12]}..., not the expected "
                         f"{sha[:12]}...: refusing to compile bytes other than the recorded ones")
    if (why := unavailable()) is not None:
        raise RuntimeError(f"cannot compile a CuTe DSL variant: {why}")
    key = (sha, dsl_arch(arch))
    if key not in _LOADED:
        module = _load(module_source, f"cute_{sha[:12]}")
        if not callable(getattr(module, "run", None)):
            raise ValueError("CuTe variant defines no callable `run`")
        _LOADED[key] = module
    return _LOADED[key].run


def check_compiles(path: str | Path, arch: str = "sm_90a", timeout: float = 600.0) -> list[str]:
    """Errors from compiling the variant at `path` for `arch` (empty list: it compiles)."""
    path = Path(path)
    if (why := unavailable()) is not None:
        return [f"{path}: not checked: {why}"]
    env = {**os.environ, "CUTE_DSL_ARCH": dsl_arch(arch)}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    try:
        proc = subprocess.run([sys.executable, "-m", "model.registry.cute", str(path), arch],
                              env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [f"{path}: compiling for {arch} took more than {timeout:.0f} s"]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
        return [f"{path}: compile check exited {proc.returncode}: " + "\n".join(tail)]
    report = json.loads(lines[-1])
    return [f"{path}: {e}" for e in report.get("errors", [])]


def _child(path: Path, arch: str) -> dict:
    source = path.read_text()
    if declared_language(source) != "cute":
        return {"errors": ['does not declare LANGUAGE = "cute"'], "compiled": []}
    module = _load(source, f"cute_check_{path.stem}")
    missing = [n for n in ("run", "precompile") if not callable(getattr(module, n, None))]
    if missing:
        return {"errors": [f"defines no callable {', '.join(missing)} (a CuTe variant exports "
                           "run(...) and precompile(arch) -> list[str])"], "compiled": []}
    try:
        compiled = list(module.precompile(dsl_arch(arch)))
    except Exception as exc:  # the DSL's errors are the check's findings
        return {"errors": [f"{type(exc).__name__}: {exc}"[:4000]], "compiled": []}
    if not compiled:
        return {"errors": ["precompile() compiled nothing"], "compiled": []}
    return {"errors": [], "compiled": compiled}


if __name__ == "__main__":
    _path, _arch = Path(sys.argv[1]), (sys.argv[2] if len(sys.argv) > 2 else "sm_90a")
    print(json.dumps(_child(_path, _arch)))
