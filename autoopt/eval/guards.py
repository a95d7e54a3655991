"""Anti-cheat checks: static screen of a variant's source and behavioural guards around its calls.

The static screen runs in the parent before any candidate code executes; it works on the AST and
rejects imports outside a short allow-list (torch, triton, numpy, math, functools, typing, ...),
the reference (`model.ops`) and the harness (`autoopt`), dynamic code (eval/exec/compile/
__import__/getattr), file, network and process access, torch.compile, CUDA streams and graphs,
tensor-subclass dispatch tricks, dunder introspection and monkeypatching (assigning attributes
of imported modules such as `torch.cuda.Event = ...` or `time.perf_counter = ...`). Reasons
start with "static screen:".

The behavioural guards (poisoning, unmodified inputs, aliasing, output structure, runtime
monkeypatch detection, the floor) are used by the verify job inside the sandbox child.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from typing import Any

ALLOWED_IMPORTS = frozenset({
    "__future__", "math", "functools", "typing", "dataclasses", "itertools", "operator",
    "collections", "enum", "torch", "triton", "numpy",
})
_MODULE_WHY = {
    "subprocess": "process spawning", "os": "file/OS access", "sys": "interpreter access",
    "socket": "network", "ssl": "network", "http": "network", "urllib": "network",
    "requests": "network", "httpx": "network", "aiohttp": "network", "ftplib": "network",
    "io": "file I/O", "pathlib": "file I/O", "shutil": "file I/O", "tempfile": "file I/O",
    "glob": "file I/O", "mmap": "file I/O", "pickle": "deserialization",
    "marshal": "deserialization", "shelve": "deserialization", "importlib": "dynamic import",
    "builtins": "dynamic code", "runpy": "dynamic code", "code": "dynamic code",
    "ctypes": "native code", "cffi": "native code", "threading": "threads",
    "multiprocessing": "processes", "concurrent": "threads", "asyncio": "threads",
    "signal": "signals", "atexit": "exit hooks", "gc": "interpreter introspection",
    "inspect": "interpreter introspection", "time": "timers", "pty": "process spawning",
}
_BANNED_NAMES = {
    "eval": "calls eval", "exec": "calls exec", "compile": "calls compile",
    "__import__": "calls __import__", "open": "uses open() (file I/O)",
    "getattr": "uses getattr (dynamic attribute access)", "setattr": "uses setattr",
    "delattr": "uses delattr", "globals": "uses globals()", "locals": "uses locals()",
    "vars": "uses vars()", "breakpoint": "calls breakpoint",
}
_OK_DUNDERS = frozenset({"__init__", "__name__", "__doc__", "__all__", "__annotations__"})
# Dotted prefixes (after resolving import aliases) and why they are refused.
_BANNED_PATHS = (
    ("torch.compile", "uses torch.compile"), ("torch._dynamo", "uses torch.compile"),
    ("torch._inductor", "uses torch.compile"), ("torch.hub", "uses torch.hub (network)"),
    ("torch.utils.cpp_extension", "builds native extensions"),
    ("torch.save", "file I/O (torch.save)"), ("torch.load", "file I/O (torch.load)"),
    ("torch.from_file", "file I/O (torch.from_file)"),
    ("torch.library", "overrides torch operators (torch.library)"),
    ("torch.overrides", "overrides torch operators"),
    ("torch.utils._python_dispatch", "overrides torch operators"),
    ("torch._C", "uses torch._C internals"), ("torch.ops.load_library", "loads native code"),
    ("torch.cuda.Stream", "uses CUDA streams (side-stream work)"),
    ("torch.cuda.stream", "uses CUDA streams (side-stream work)"),
    ("torch.cuda.set_stream", "uses CUDA streams (side-stream work)"),
    ("torch.cuda.ExternalStream", "uses CUDA streams (side-stream work)"),
    ("torch.cuda.default_stream", "uses CUDA streams (side-stream work)"),
    ("torch.Stream", "uses CUDA streams (side-stream work)"),
    ("torch.cuda.Event", "uses CUDA events (timing/stream tricks)"),
    ("torch.cuda.graph", "captures CUDA graphs"), ("torch.cuda.CUDAGraph", "captures CUDA graphs"),
    ("torch.cuda.memory", "inspects the caching allocator"),
    ("torch.cuda.caching_allocator", "inspects the caching allocator"),
    ("torch.cuda._sleep", "uses torch.cuda._sleep"),
    ("torch.set_", "changes torch global state"),
    ("torch.use_deterministic_algorithms", "changes torch global state"),
    ("numpy.save", "file I/O (numpy)"), ("numpy.load", "file I/O (numpy)"),
    ("numpy.fromfile", "file I/O (numpy)"), ("numpy.memmap", "file I/O (numpy)"),
    ("numpy.loadtxt", "file I/O (numpy)"), ("numpy.genfromtxt", "file I/O (numpy)"),
    ("numpy.ctypeslib", "native code"), ("numpy.lib", "file I/O (numpy)"),
)
# Attribute names refused on any object (the base may not resolve statically).
_BANNED_ATTRS = {
    "from_file": "file I/O (from_file)", "tofile": "file I/O (tofile)",
    "fromfile": "file I/O (fromfile)", "load_library": "loads native code",
    "load_inline": "builds native extensions", "cpp_extension": "builds native extensions",
    "wait_stream": "uses CUDA streams (side-stream work)",
    "record_stream": "uses CUDA streams (side-stream work)",
    "_dynamo": "uses torch.compile", "_inductor": "uses torch.compile",
    "compile": "uses torch.compile or compile()",
    "Stream": "uses CUDA streams (side-stream work)",
    "stream": "uses CUDA streams (side-stream work)",
    "set_stream": "uses CUDA streams (side-stream work)",
    "ExternalStream": "uses CUDA streams (side-stream work)",
    "Event": "uses CUDA events (timing/stream tricks)", "CUDAGraph": "captures CUDA graphs",
    "_sleep": "uses torch.cuda._sleep", "hub": "uses torch.hub (network)",
    "library": "overrides torch operators (torch.library)",
}
_DISPATCH_HOOKS = frozenset({"__torch_function__", "__torch_dispatch__"})


def static_screen(source: str, filename: str = "<variant>") -> list[str]:
    """Reasons the source is refused before it runs; empty when it passes."""
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as e:
        return [f"static screen: syntax error at line {e.lineno}: {e.msg}"]
    aliases = _aliases(tree)
    reasons: list[str] = []
    for node in ast.walk(tree):
        reasons.extend(_check_node(node, aliases))
    if "run" not in _top_level_names(tree):
        reasons.append("static screen: defines no top-level `run` (expected "
                       "run(*args, config=None) with the op's signature)")
    return _unique(f"static screen: {r}" if not r.startswith("static screen") else r
                   for r in reasons)


def _unique(items: Iterable[str]) -> list[str]:
    seen: dict[str, None] = {}
    for i in items:
        seen.setdefault(i, None)
    return list(seen)


def _top_level_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.ImportFrom):
            names.update(a.asname or a.name for a in node.names)
    return names


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> dotted module path, for every name bound by an import statement."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    out[a.asname] = a.name
                else:
                    top = a.name.split(".")[0]
                    out[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    # `T = torch` / `c = torch.cuda`: the new name stands for the module too.
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(
                node.targets[0], ast.Name):
            path = _dotted(node.value, out)
            if path is not None and node.targets[0].id not in out:
                out[node.targets[0].id] = path
    return out


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in aliases:
        return ".".join([aliases[node.id], *reversed(parts)])
    return None


def _import_reason(module: str) -> str | None:
    top = module.split(".")[0]
    if top == "model":
        return f"imports the reference ({module})"
    if top == "autoopt":
        return f"imports autoopt (the harness: {module})"
    if top in ALLOWED_IMPORTS:
        return _path_reason(module)
    why = _MODULE_WHY.get(top, f"not in the allowed list: {', '.join(sorted(ALLOWED_IMPORTS))}")
    return f"imports {top} ({why})"


def _path_reason(path: str) -> str | None:
    for prefix, why in _BANNED_PATHS:
        if path == prefix or path.startswith(prefix + ".") or (
                prefix.endswith("_") and path.startswith(prefix)):
            return f"{why}: {path}"
    return None


def _check_node(node: ast.AST, aliases: dict[str, str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [r for a in node.names if (r := _import_reason(a.name))]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            return ["relative import (variants are loaded by path, not as a package)"]
        mod = node.module or ""
        reasons = [r for r in [_import_reason(mod)] if r]
        reasons += [r for a in node.names if (r := _path_reason(f"{mod}.{a.name}"))]
        return reasons
    if isinstance(node, ast.Name):
        if node.id in _BANNED_NAMES and node.id not in aliases:
            return [_BANNED_NAMES[node.id]]
        if _is_dunder(node.id) and node.id not in _OK_DUNDERS:
            return [f"uses {node.id} (introspection)"]
        return []
    if isinstance(node, ast.Attribute):
        return _check_attribute(node, aliases)
    if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete):
        targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
        return [r for t in targets for r in _patch_reasons(t, aliases)]
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in _DISPATCH_HOOKS:
        return [f"defines {node.name} (overrides torch dispatch)"]
    return []


def _check_attribute(node: ast.Attribute, aliases: dict[str, str]) -> list[str]:
    reasons = []
    if _is_dunder(node.attr) and node.attr not in _OK_DUNDERS:
        reasons.append(f"accesses {node.attr} (introspection)")
    path = _dotted(node, aliases)
    if path and (r := _path_reason(path)):
        reasons.append(r)
    elif node.attr in _BANNED_ATTRS:
        reasons.append(_BANNED_ATTRS[node.attr])
    return reasons


def _patch_reasons(target: ast.AST, aliases: dict[str, str]) -> list[str]:
    if isinstance(target, ast.Tuple | ast.List):
        return [r for t in target.elts for r in _patch_reasons(t, aliases)]
    while isinstance(target, ast.Subscript):
        target = target.value
    if isinstance(target, ast.Attribute):
        path = _dotted(target, aliases)
        if path:
            return [f"monkeypatches {path}"]
    return []


def _is_dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


# ---- behavioural guards (run inside the sandbox child; torch imported lazily) ----------------

# CPU children run with MALLOC_PERTURB_=128: glibc fills every fresh allocation with 0x7F bytes
# and freed memory with 0x80 bytes, so stale or unwritten CPU outputs hold these patterns.
MALLOC_PERTURB = "128"
_POISON_BYTES = (0xFF, 0x7F, 0x80)


def poison_allocator(device: str, nbytes: Iterable[int], copies: int = 4) -> None:
    """Fill the allocator's free blocks with NaN (0xFF) so unwritten outputs read as NaN.

    On cuda the caching allocator hands freed blocks out again: free the cache, then allocate,
    fill and free `copies` blocks of every output size plus one large block, so whatever the
    candidate allocates next (the reference's old block included) holds 0xFF bytes.
    """
    import os

    import torch

    if not device.startswith("cuda") and os.environ.get("MALLOC_PERTURB_") == MALLOC_PERTURB:
        return  # glibc already fills fresh (0x7F) and freed (0x80) CPU memory
    sizes = [int(n) for n in nbytes if n > 0]
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    blocks = [torch.empty(n, dtype=torch.uint8, device=device).fill_(0xFF)
              for n in sizes for _ in range(copies)]
    blocks.append(torch.empty(max(sum(sizes) * copies, 1 << 20), dtype=torch.uint8,
                              device=device).fill_(0xFF))
    del blocks
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def poison_mask(t: Any) -> Any:
    """Elements whose bit pattern is a poison fill (NaN 0xFF.., malloc 0x7F.., freed 0x80..)."""
    import torch

    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    b = t.contiguous().view(width)
    mask = torch.zeros_like(b, dtype=torch.bool)
    for byte in _POISON_BYTES:
        signed = width != torch.uint8
        pattern = int.from_bytes(bytes([byte]) * t.element_size(), "little", signed=signed)
        mask |= b == pattern
    if t.dtype.is_floating_point:
        mask |= torch.isnan(t)
    return mask


def unwritten(out: Any, ref: Any) -> int:
    """Elements of `out` that still hold poison where the reference holds something else."""
    from .numerics import bits_equal

    return int((poison_mask(out) & ~bits_equal(out, ref)).sum())


def storage_range(t: Any) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


def same_tensor(a: Any, b: Any) -> bool:
    """Whether `a` is the tensor `b` (same storage, offset, shape and strides)."""
    import torch

    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.data_ptr() == b.data_ptr() and a.shape == b.shape
            and a.stride() == b.stride() and a.device == b.device)


def aliased(outs: tuple, inputs: tuple) -> list[tuple[int, int]]:
    """(output index, input index) pairs whose storages overlap."""
    import torch

    pairs = []
    for i, o in enumerate(outs):
        a0, a1 = storage_range(o)
        for j, x in enumerate(inputs):
            if isinstance(x, torch.Tensor):
                b0, b1 = storage_range(x)
                if a0 < b1 and b0 < a1 and a1 > a0:
                    pairs.append((i, j))
    return pairs


def structure_errors(outs: Any, ref: tuple) -> list[str]:
    """What is wrong with the output's type, count, dtype or shape (empty when right)."""
    import torch

    got = outs if isinstance(outs, tuple | list) else (outs,)
    if len(got) != len(ref):
        return [f"wrong dtype/shape: returned {len(got)} outputs, expected {len(ref)}"]
    errs = []
    for i, (o, r) in enumerate(zip(got, ref, strict=True)):
        if type(o) is not torch.Tensor:
            errs.append(f"wrong dtype/shape: output {i} is {type(o).__name__}, expected a plain "
                        f"torch.Tensor")
        elif o.dtype != r.dtype or tuple(o.shape) != tuple(r.shape):
            errs.append(f"wrong dtype/shape: output {i} is {str(o.dtype)[6:]} "
                        f"{list(o.shape)}, expected {str(r.dtype)[6:]} {list(r.shape)}")
        elif o.device != r.device:
            errs.append(f"wrong dtype/shape: output {i} is on {o.device}, expected {r.device}")
    return errs


def _watched_modules() -> dict[str, Any]:
    import math
    import time

    import torch
    import torch.nn.functional as F

    mods = {"time": time, "math": math, "torch": torch, "torch.Tensor": torch.Tensor,
            "torch.nn.functional": F, "torch.cuda": torch.cuda, "torch.testing": torch.testing}
    try:
        import triton

        mods["triton"] = triton
    except ImportError:  # pragma: no cover
        pass
    return mods


def snapshot_globals() -> dict[str, int]:
    """Identity of every attribute of the modules a cheat would patch (timers, torch)."""
    snap = {}
    for name, mod in _watched_modules().items():
        for key, value in list(vars(mod).items()):
            snap[f"{name}.{key}"] = id(value)
    return snap


def patched_globals(snapshot: dict[str, int]) -> list[str]:
    """Attributes whose identity changed (or vanished) since `snapshot`."""
    now = snapshot_globals()
    return sorted(k for k, v in snapshot.items() if now.get(k) != v)


# A measured copy kernel is the bandwidth ceiling; a faster op is impossible.
# Measured copy bandwidth is ~0.9 of HBM peak on an H200 (4.26 vs 4.8 TB/s): only a time under
# 0.8 x the measured floor is beyond what the hardware can do, whatever the copy test missed.
FLOOR_MARGIN = 0.8


def floor_violation(median_us: float, floor_us: float, margin: float = FLOOR_MARGIN) -> str | None:
    if floor_us > 0 and median_us < floor_us * margin:
        return (f"faster than the floor: {median_us:.2f} us < {margin:g} x floor {floor_us:.2f} us "
                f"(bytes / measured bandwidth): impossible, the timing or the kernel is wrong")
    return None
