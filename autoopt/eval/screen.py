"""The static screen: what a variant's source may use, as an allowlist.

It runs in the judge before any candidate code executes, on the AST:
- imports: only the modules in `ALLOWED_MODULES` (torch and its nn.functional and cuda modules,
  triton and triton.language with libdevice, numpy, math, a few pure-Python helpers, CuTe DSL
  and FlashInfer for variants in those languages);
- attribute chains that start at an imported module are resolved against the real modules in the
  judge, so a module reached through an allowed one (`torch.sys`, `triton.knobs.os`,
  `np.core`, `typing.sys`) is refused wherever it is spelled, as are the callables that touch
  files, processes, streams, graphs, timers or the compiler (`DENIED_PATHS`);
- names: a variant may read only names it binds itself and the builtins in `SAFE_BUILTINS`
  (no eval/exec/compile/getattr/setattr/globals/vars/open/__import__/type, no `__builtins__`);
- dunder access anywhere, frame and traceback attributes (`f_back`, `gi_frame`, ...), dangerous
  attribute names on any object (`sys`, `os`, `compile`, `load_library`, ...), and dunder names
  hidden in strings (`"{0.__class__}".format`, `attrgetter("__globals__")`) are refused;
- assigning or deleting an attribute of an imported module (monkeypatching) is refused.
Every reason starts with "static screen:".
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import types
import warnings
from collections.abc import Iterable
from typing import Any

# Modules a variant may import and reach (a submodule not listed is refused, however reached).
LANGUAGE_MODULES: dict[str, frozenset[str]] = {
    "common": frozenset({
        "__future__", "math", "functools", "typing", "dataclasses", "itertools", "operator",
        "collections", "collections.abc", "enum", "numpy",
        "torch", "torch.nn", "torch.nn.functional", "torch.cuda", "torch.backends",
        "torch.backends.cpu",
    }),
    "triton": frozenset({
        "triton", "triton.language", "triton.language.math", "triton.language.extra",
        "triton.language.extra.libdevice", "triton.language.extra.cuda",
        "triton.language.extra.cuda.libdevice",
    }),
    "cute": frozenset({
        "cutlass", "cutlass.cute", "cutlass.cute.runtime", "cutlass.cute.arch",
        "cutlass.cute.math", "cutlass.cute.nvgpu", "cutlass.cute.nvgpu.warpgroup",
        "cutlass.cute.nvgpu.cpasync", "cutlass.cute.nvgpu.warp", "cutlass.cute.nvgpu.tcgen05",
        "cutlass.utils", "cutlass.utils.hopper_helpers", "cutlass.utils.blackwell_helpers",
        "cutlass.pipeline", "cutlass.torch", "cuda", "cuda.bindings", "cuda.bindings.driver",
    }),
    "flashinfer": frozenset({"flashinfer"}),
}
ALLOWED_MODULES = frozenset().union(*LANGUAGE_MODULES.values())
# Names a denied attribute would refuse that are a kernel language's own: CuTe's JIT compiler.
ALLOWED_PATHS = frozenset({"cutlass.cute.compile"})
# Kept for callers of the old screen (the audit hook reads the top-level names).
ALLOWED_IMPORTS = frozenset(m.split(".")[0] for m in ALLOWED_MODULES)

SAFE_BUILTINS = frozenset({
    "abs", "all", "any", "bool", "bytearray", "bytes", "callable", "chr", "classmethod",
    "complex", "dict", "divmod", "enumerate", "filter", "float", "format", "frozenset", "hash",
    "int", "isinstance", "issubclass", "iter", "len", "list", "map", "max", "min", "next",
    "object", "ord", "pow", "print", "property", "range", "repr", "reversed", "round", "set",
    "slice", "sorted", "staticmethod", "str", "sum", "super", "tuple", "zip", "NotImplemented",
    "Ellipsis", "Exception", "ValueError", "TypeError", "RuntimeError", "KeyError",
    "IndexError", "NotImplementedError", "AssertionError", "ArithmeticError",
    "ZeroDivisionError", "OverflowError", "AttributeError", "LookupError", "StopIteration",
    # Optional Triton features are imported under try/except ImportError.
    "ImportError", "ModuleNotFoundError",
})
# Dunder names a variant may read, define or assign (module name checks, constructors).
_OK_DUNDER_NAMES = frozenset({"__name__", "__all__", "__doc__"})
_OK_DUNDER_DEFS = frozenset({"__init__", "__post_init__", "__call__", "__repr__"})

_WHICH_GPU = "reads which GPU it runs on (a served TP rank is not on the judge's GPU)"
# Callables and attributes of allowed modules that are refused, with why (prefix match).
DENIED_PATHS: tuple[tuple[str, str], ...] = (
    ("torch.compile", "uses torch.compile"), ("torch.compiler", "uses torch.compile"),
    ("torch.jit", "uses a compiler (torch.jit)"), ("torch.export", "uses a compiler (export)"),
    ("torch.save", "file I/O (torch.save)"), ("torch.load", "file I/O (torch.load)"),
    ("torch.from_file", "file I/O (torch.from_file)"),
    ("torch.set_", "changes torch global state"),
    ("torch.use_deterministic_algorithms", "changes torch global state"),
    ("torch.Stream", "uses CUDA streams (side-stream work)"),
    ("torch.Event", "uses CUDA events (timers)"),
    ("torch.cuda.Stream", "uses CUDA streams (side-stream work)"),
    ("torch.cuda.ExternalStream", "uses CUDA streams (side-stream work)"),
    ("torch.cuda.stream", "uses CUDA streams (side-stream work)"),
    ("torch.cuda.set_stream", "uses CUDA streams (side-stream work)"),
    ("torch.cuda.default_stream", "uses CUDA streams (side-stream work)"),
    ("torch.cuda.Event", "uses CUDA events (timers)"),
    ("torch.cuda.get_stream_from_external", "uses CUDA streams (side-stream work)"),
    ("torch.cuda.StreamContext", "uses CUDA streams (side-stream work)"),
    ("torch.cuda.graph", "captures CUDA graphs"), ("torch.cuda.CUDAGraph", "captures CUDA graphs"),
    ("torch.cuda.make_graphed_callables", "captures CUDA graphs"),
    ("torch.cuda.is_current_stream_capturing", "inspects graph capture (telling timing apart)"),
    ("torch.cuda.set_", "changes torch global state"),
    ("torch.cuda.memory_", "inspects the caching allocator"),
    ("torch.cuda.max_memory_", "inspects the caching allocator"),
    ("torch.cuda.empty_cache", "manipulates the caching allocator"),
    ("torch.cuda.caching_allocator", "inspects the caching allocator"),
    # What the device looks like (free memory, load, clocks) tells a verifier's worker from a
    # serving process: a variant has no use for it.
    ("torch.cuda.mem_get_info", "inspects the device (telling serving apart)"),
    ("torch.cuda.list_gpu_processes", "inspects the device (telling serving apart)"),
    ("torch.cuda.utilization", "inspects the device (telling serving apart)"),
    ("torch.cuda.temperature", "inspects the device (telling serving apart)"),
    ("torch.cuda.power_draw", "inspects the device (telling serving apart)"),
    ("torch.cuda.clock_rate", "inspects the device (telling serving apart)"),
    ("torch.cuda.device_memory_used", "inspects the device (telling serving apart)"),
    ("torch.cuda.graph_pool_handle", "captures CUDA graphs"),
    # How the process is set up (the judge's CPU worker runs one thread; a farm worker sees one
    # GPU): the same kernel must compute the same thing whatever the answer.
    ("torch.get_num_threads", "inspects the process (telling serving apart)"),
    ("torch.get_num_interop_threads", "inspects the process (telling serving apart)"),
    ("torch.cuda.device_count", "inspects the process (telling serving apart)"),
    ("torch.cuda.is_initialized", "inspects the process (telling serving apart)"),
    ("torch.cuda.get_allocator_backend", "inspects the caching allocator"),
    ("torch.cuda.ipc_collect", "inter-process memory"),
    # Which GPU it runs on: the judge's worker runs on one, a served TP rank on GPU 1..7.
    ("torch.cuda.current_device", _WHICH_GPU),
    ("torch.cuda.get_rng_state", "reads the RNG state (telling runs apart)"),
    ("torch.get_rng_state", "reads the RNG state (telling runs apart)"),
    ("torch.initial_seed", "reads the RNG state (telling runs apart)"),
    ("torch.cuda.initial_seed", "reads the RNG state (telling runs apart)"),
    # The global generators are the ones serving samples with: reseeding them from a kernel
    # changes what a served request draws; reading them tells runs apart. A local
    # torch.Generator stays allowed.
    ("torch.manual_seed", "changes the RNG state serving samples with"),
    ("torch.seed", "changes the RNG state serving samples with"),
    ("torch.cuda.manual_seed", "changes the RNG state serving samples with"),
    ("torch.cuda.seed", "changes the RNG state serving samples with"),
    ("torch.cuda.manual_seed_all", "changes the RNG state serving samples with"),
    ("torch.cuda.seed_all", "changes the RNG state serving samples with"),
    ("torch.default_generator", "reads or changes the RNG state serving samples with"),
    ("torch.cuda.default_generators", "reads or changes the RNG state serving samples with"),
    ("numpy.save", "file I/O (numpy)"), ("numpy.load", "file I/O (numpy)"),
    ("numpy.savetxt", "file I/O (numpy)"), ("numpy.savez", "file I/O (numpy)"),
    ("numpy.savez_compressed", "file I/O (numpy)"),
    ("numpy.fromfile", "file I/O (numpy)"), ("numpy.memmap", "file I/O (numpy)"),
    ("numpy.loadtxt", "file I/O (numpy)"), ("numpy.genfromtxt", "file I/O (numpy)"),
    ("numpy.fromregex", "file I/O (numpy)"), ("numpy.DataSource", "file I/O (numpy)"),
    ("operator.attrgetter", "dynamic attribute access (attrgetter)"),
    ("operator.methodcaller", "dynamic attribute access (methodcaller)"),
    ("typing.get_type_hints", "evaluates strings as code"),
    ("typing.ForwardRef", "evaluates strings as code"),
    ("dataclasses.make_dataclass", "generates code"),
    ("triton.language.extra.cuda.globaltimer", "reads a GPU timer"),
    # The config that runs must be the one verified: tuning is the registry's, per bucket.
    ("triton.autotune", "tunes by timing at run time (export CONFIG_SPACE instead)"),
)
# Attribute names refused on any object (the base may not resolve statically), with why.
DENIED_ATTRS: dict[str, str] = {
    **{m: "interpreter access" for m in ("sys", "builtins", "gc", "inspect", "importlib",
                                          "_sys", "bltns", "_thread", "runpy", "code")},
    **{m: "OS/process access" for m in ("os", "subprocess", "posix", "signal", "pty",
                                         "multiprocessing", "threading", "shutil", "pathlib",
                                         "io", "socket", "tempfile", "mmap", "pickle",
                                         "marshal", "ctypes", "_ctypes", "cffi")},
    "time": "timers", "perf_counter": "timers", "globaltimer": "reads a GPU timer",
    "globaltimer_lo": "reads a GPU timer", "globaltimer_hi": "reads a GPU timer",
    "clock": "reads a GPU timer", "clock64": "reads a GPU timer",
    "compile": "uses torch.compile or compile()", "_dynamo": "uses torch.compile",
    "_inductor": "uses torch.compile", "jit_compile": "uses a compiler",
    "load_library": "loads native code", "import_module": "dynamic import",
    "load_inline": "builds native extensions", "cpp_extension": "builds native extensions",
    "from_file": "file I/O (from_file)", "tofile": "file I/O (tofile)",
    "fromfile": "file I/O (fromfile)", "wait_stream": "uses CUDA streams (side-stream work)",
    "record_stream": "uses CUDA streams (side-stream work)",
    "Stream": "uses CUDA streams (side-stream work)", "stream": "uses CUDA streams",
    "Event": "uses CUDA events (timers)", "CUDAGraph": "captures CUDA graphs",
    "share_memory_": "shared memory", "library": "overrides torch operators",
    "get_device": _WHICH_GPU,
    # A cache's hit count is a count of calls (behaviour that can change after any number).
    "cache_info": "reads a cache's statistics, whose hits count calls",
}
_FRAME_ATTR = re.compile(r"^(f|tb|gi|cr|ag|co)_[a-z]+$")
_DUNDER_IN_STRING = re.compile(r"__[A-Za-z][A-Za-z0-9_]*__")
_TIMER_IN_STRING = re.compile(r"globaltimer|%clock|clock64")
_DISPATCH_HOOKS = frozenset({"__torch_function__", "__torch_dispatch__"})
_MISSING = object()


def static_screen(source: str, filename: str = "<variant>") -> list[str]:
    """Reasons the source is refused before it runs; empty when it passes."""
    try:
        tree = ast.parse(source, filename=filename)
    except SyntaxError as e:
        return [f"static screen: syntax error at line {e.lineno}: {e.msg}"]
    s = _Screen(tree)
    reasons = s.run() + _module_state_reasons(tree) + _inline_asm_reasons(tree)
    if "run" not in _top_level_names(tree):
        reasons.append("defines no top-level `run` (expected run(*args, config=None) with the "
                       "op's signature)")
    return _unique(f"static screen: {r}" for r in reasons)


def _module_state_reasons(tree: ast.Module) -> list[str]:
    """A function that rebinds a module-level name (`global`) or updates module-level state in
    place with an augmented assignment (`_CALLS[0] += 1`): a call counter, the simplest way to
    be exact for as many calls as a verifier makes and wrong after. Caches that only store
    (`_CACHE[key] = kernel`) are not refused."""
    module_names = set()
    for node in tree.body:
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, ast.AnnAssign | ast.AugAssign) else [])
        for t in targets:
            module_names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        local = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)}
        declared = set()
        own = list(_own_nodes(fn))
        for node in own:
            if isinstance(node, ast.Global | ast.Nonlocal):
                declared.update(node.names)
                kind = "global" if isinstance(node, ast.Global) else "nonlocal"
                out += [f"declares {kind} {n} in {getattr(fn, 'name', 'a lambda')} (state that "
                        "outlives a call)" for n in node.names]
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                local.add(node.id)
        for node in own:
            if not isinstance(node, ast.AugAssign):
                continue
            base = node.target
            while isinstance(base, ast.Subscript | ast.Attribute):
                base = base.value
            if not isinstance(base, ast.Name) or node.target is base:
                continue  # `n += 1` on a plain name is local unless declared (refused above)
            if base.id in module_names and (base.id not in local or base.id in declared):
                out.append(f"counts or accumulates in module-level {base.id} (in "
                           f"{getattr(fn, 'name', 'a lambda')}): behaviour that can change with "
                           "the number of calls")
    return out


def _tensor_has(name: str) -> bool:
    """A name torch tensors carry (a variant cannot make `_version` its own by defining it)."""
    import torch

    return hasattr(torch.Tensor, name) or name in ("_version", "_base", "_cdata")


_ASM = "inline_asm_elementwise"
_DRIVER_NAMES = frozenset({"CUstream"})


def _inline_asm_reasons(tree: ast.Module) -> list[str]:
    """Inline PTX only as a literal string in the call itself: the string screen then sees all
    of it. Assembled at run time (`'%glob' + 'altimer'`), it could read the GPU's clock (a
    kernel that changes with the date) or anything else the screen never saw."""
    calls = {id(n.func): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and any(a.name == _ASM for a in node.names):
            out.append(f"imports {_ASM} by name (call it as tl.{_ASM}(...) with a literal "
                       "string)")
        elif isinstance(node, ast.Attribute) and node.attr == _ASM:
            call = calls.get(id(node))
            asm = None
            if call is not None:
                asm = call.args[0] if call.args else next(
                    (k.value for k in call.keywords if k.arg == "asm"), None)
            if call is None:
                out.append(f"uses {_ASM} other than by calling it (inline assembly the screen "
                           "cannot read)")
            elif not (isinstance(asm, ast.Constant) and isinstance(asm.value, str)):
                out.append(f"calls {_ASM} with assembly built at run time (it must be a "
                           "literal string the screen can read)")
    return out


def _own_nodes(fn: ast.AST) -> Iterable[ast.AST]:
    """The nodes of `fn`'s own scope: nested functions and lambdas are scopes of their own."""
    todo = list(ast.iter_child_nodes(fn))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            todo.extend(ast.iter_child_nodes(node))


def _is_device(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "device"


def _which_gpu_reasons(node: ast.Compare | ast.Call) -> list[str]:
    """A tensor's device compared with a fixed one, turned into text, or a device named by its
    index: the plain ways to behave differently on a served rank's GPU. Comparing two inputs'
    devices (`x.device != w.device`) is what honest checks do and passes. A device reaching text
    through an f-string is not caught (error messages print devices): docs/judge.md."""
    if isinstance(node, ast.Compare):
        operands = [node.left, *node.comparators]
        if any(_is_device(o) for o in operands) and any(
                isinstance(o, ast.Constant | ast.Call | ast.JoinedStr | ast.BinOp | ast.Tuple |
                           ast.List | ast.Set) for o in operands):
            return [f"compares a tensor's device with a fixed one ({_WHICH_GPU})"]
        return []
    f = node.func
    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
    if name in ("str", "repr", "format", "hash") and any(_is_device(a) for a in node.args):
        return [f"turns a tensor's device into {name}() ({_WHICH_GPU})"]
    if name == "device" and (len(node.args) > 1 or any(
            isinstance(a, ast.Constant) and ":" in str(a.value) for a in node.args)):
        return [f"names a GPU by index ({_WHICH_GPU})"]
    return []


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


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


def _is_dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


def _docstrings(tree: ast.Module) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


class _Screen:
    def __init__(self, tree: ast.Module) -> None:
        self.tree = tree
        self.aliases: dict[str, str] = {}  # local name -> dotted module path (or attribute path)
        self.bound: set[str] = set()
        self.reasons: list[str] = []
        self.docstrings = _docstrings(tree)
        self.own_private: set[str] = set()  # private attribute names the variant defines

    def run(self) -> list[str]:
        self._collect_bindings()
        for node in ast.walk(self.tree):
            self._check(node)
        return self.reasons

    # ---- bindings ----------------------------------------------------------------------------
    def _collect_bindings(self) -> None:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    name = a.asname or a.name.split(".")[0]
                    self.aliases[name] = a.name if a.asname else name
                    self.bound.add(name)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                    self.bound.add(a.asname or a.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store | ast.Del):
                self.bound.add(node.id)
            elif isinstance(node, ast.arg):
                self.bound.add(node.arg)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                self.bound.add(node.name)
            elif isinstance(node, ast.ExceptHandler) and node.name:
                self.bound.add(node.name)
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    names = ([item.name] if isinstance(item, ast.FunctionDef |
                                                       ast.AsyncFunctionDef) else
                             [t.id for t in getattr(item, "targets", [getattr(item, "target",
                                                                              None)])
                              if isinstance(t, ast.Name)])
                    self.own_private.update(n for n in names if n.startswith("_"))
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    node.attr.startswith("_"):
                self.own_private.add(node.attr)
        # `T = torch` / `c = torch.cuda`: the new name stands for the module path too.
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(
                    node.targets[0], ast.Name) and node.targets[0].id not in self.aliases:
                path = self._dotted(node.value)
                if path is not None:
                    self.aliases[node.targets[0].id] = path

    def _dotted(self, node: ast.AST) -> str | None:
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in self.aliases:
            return ".".join([self.aliases[node.id], *reversed(parts)])
        return None

    # ---- checks ------------------------------------------------------------------------------
    def _check(self, node: ast.AST) -> None:
        r = self.reasons
        if isinstance(node, ast.Import):
            for a in node.names:
                r.extend(_path_reasons(a.name, module=True))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                r.append("relative import (variants are loaded by path, not as a package)")
            elif any(a.name == "*" for a in node.names):
                r.append(f"star import from {node.module}")
            else:
                r.extend(_path_reasons(node.module or "", module=True))
                for a in node.names:
                    r.extend(_path_reasons(f"{node.module}.{a.name}"))
        elif isinstance(node, ast.Name):
            r.extend(self._name_reasons(node))
        elif isinstance(node, ast.Attribute):
            r.extend(self._attribute_reasons(node))
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete):
            targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
            r.extend(x for t in targets for x in self._patch_reasons(t))
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if node.name in _DISPATCH_HOOKS:
                r.append(f"defines {node.name} (overrides torch dispatch)")
            elif _is_dunder(node.name) and node.name not in _OK_DUNDER_DEFS:
                r.append(f"defines {node.name} (introspection)")
        elif isinstance(node, ast.ClassDef) and node.keywords:
            r.append(f"class {node.name} passes keywords (metaclass tricks)")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str | bytes):
            r.extend(self._string_reasons(node))
        elif isinstance(node, ast.Global | ast.Nonlocal):
            r.extend(f"uses {n} (introspection)" for n in node.names if _is_dunder(n))
        elif isinstance(node, ast.Compare | ast.Call):
            r.extend(_which_gpu_reasons(node))
        elif isinstance(node, ast.MatchClass):
            # `case object(__class__=c)` reads attributes by name, like getattr.
            for attr in node.kwd_attrs:
                if _is_dunder(attr) or _FRAME_ATTR.match(attr) or attr in DENIED_ATTRS:
                    r.append(f"matches the attribute {attr} in a class pattern (introspection)")

    def _name_reasons(self, node: ast.Name) -> list[str]:
        name = node.id
        if _is_dunder(name):
            if name in _OK_DUNDER_NAMES:
                return []
            return [f"uses {name} (introspection)"]
        if isinstance(node.ctx, ast.Load) and name not in self.bound and \
                name not in SAFE_BUILTINS:
            why = _BUILTIN_WHY.get(name, "not bound in the variant and not an allowed builtin")
            return [f"uses {name} ({why})"]
        if name in _BUILTIN_WHY and isinstance(node.ctx, ast.Store):
            return [f"rebinds the builtin {name}"]
        return []

    def _attribute_reasons(self, node: ast.Attribute) -> list[str]:
        attr = node.attr
        if attr == "index" and _is_device(node.value):
            return [f"accesses .device.index ({_WHICH_GPU})"]
        if _is_dunder(attr):
            return [f"accesses {attr} (introspection)"]
        if _FRAME_ATTR.match(attr):
            return [f"accesses {attr} (frames and code objects)"]
        path = self._dotted(node)
        if path is not None:
            return _path_reasons(path)
        if attr in DENIED_ATTRS:
            return [f"accesses .{attr} ({DENIED_ATTRS[attr]})"]
        if attr.startswith("_") and (attr not in self.own_private or _tensor_has(attr)):
            # A tensor's `_version` counts its in-place writes (a KV cache's grows with every
            # served step), `_base` and `_cdata` say how it was made: internals that tell a
            # served call from a verified one. Private names the variant defines are its own.
            return [f"reads the private attribute .{attr} of an object it did not define "
                    "(torch internals tell a served call apart)"]
        return []

    def _patch_reasons(self, target: ast.AST) -> list[str]:
        if isinstance(target, ast.Tuple | ast.List | ast.Starred):
            elts = target.elts if not isinstance(target, ast.Starred) else [target.value]
            return [r for t in elts for r in self._patch_reasons(t)]
        while isinstance(target, ast.Subscript):
            target = target.value
        if not isinstance(target, ast.Attribute):
            return []
        path = self._dotted(target)
        if path is not None:
            return [f"monkeypatches {path}"]
        base = target.value
        while isinstance(base, ast.Attribute | ast.Subscript):
            base = base.value
        if not isinstance(base, ast.Name):
            return [f"assigns an attribute of a computed object (.{target.attr})"]
        return []

    def _string_reasons(self, node: ast.Constant) -> list[str]:
        if id(node) in self.docstrings:
            return []
        text = node.value.decode("latin-1") if isinstance(node.value, bytes) else node.value
        out = []
        if m := _DUNDER_IN_STRING.search(text):
            out.append(f"names {m.group(0)} in a string (dynamic introspection)")
        if m := _TIMER_IN_STRING.search(text):
            out.append(f"names {m.group(0)} in a string (reads a GPU timer)")
        return out


_BUILTIN_WHY = {
    "eval": "calls eval", "exec": "calls exec", "compile": "calls compile",
    "__import__": "calls __import__", "open": "file I/O",
    "getattr": "dynamic attribute access", "setattr": "dynamic attribute access",
    "delattr": "dynamic attribute access", "hasattr": "dynamic attribute access",
    "globals": "interpreter access", "locals": "interpreter access",
    "vars": "interpreter access", "dir": "interpreter access", "type": "interpreter access",
    "breakpoint": "debugger", "input": "reads stdin", "exit": "exits the process",
    "quit": "exits the process", "memoryview": "raw memory", "help": "interpreter access",
    "id": "object addresses", "SystemExit": "exits the process",
    "KeyboardInterrupt": "signals", "BaseException": "catches everything",
}


def _path_reasons(path: str, module: bool = False) -> list[str]:
    """Why the dotted `path` (a module, or an attribute chain from one) is refused."""
    if path in ALLOWED_PATHS:
        return []
    if path.startswith("cuda.bindings.driver.") and path.split(".")[3] not in _DRIVER_NAMES:
        # CuTe kernels take a stream handle; the rest of the driver API reads devices, memory
        # and clocks the screen refuses everywhere else.
        return [f"calls the CUDA driver ({path}; a variant may use only "
                f"{', '.join(sorted(_DRIVER_NAMES))})"]
    for prefix, why in DENIED_PATHS:
        if path == prefix or path.startswith(prefix + ".") or (
                prefix.endswith("_") and path.startswith(prefix)):
            return [f"{why}: {path}"]
    parts = path.split(".")
    top = parts[0]
    if top == "model":
        return [f"imports the reference ({path})"]
    if top == "autoopt":
        return [f"imports autoopt (the harness: {path})"]
    if top not in ALLOWED_IMPORTS:
        return [f"imports {top} ({_MODULE_WHY.get(top, 'not in the allowed list')})"]
    if path in ALLOWED_MODULES:
        return []
    return _walk(parts, module)


def _walk(parts: list[str], module: bool) -> list[str]:
    """Resolve an attribute chain against the real modules; refuse modules off the list."""
    obj: Any = _MISSING
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        name = parts[i - 1]
        if prefix in ALLOWED_MODULES:
            obj = _import(prefix)
            continue
        if i > 1 and (_is_dunder(name) or _FRAME_ATTR.match(name)):
            return [f"accesses {name} (introspection): {prefix}"]
        if name.startswith("_"):
            return [f"accesses the private {prefix}"]
        if name in DENIED_ATTRS and prefix not in ALLOWED_PATHS:
            return [f"reaches {prefix} ({DENIED_ATTRS[name]})"]
        nxt = _getattr(obj, name) if obj is not _MISSING else _MISSING
        if nxt is _MISSING and (i == len(parts) and module or _is_module_path(prefix)):
            return [f"imports {prefix} (a module not in the allowed list)"]
        if isinstance(nxt, types.ModuleType) and nxt.__name__ not in ALLOWED_MODULES:
            via = "" if nxt.__name__ == prefix else f" through {prefix}"
            return [f"reaches the module {nxt.__name__}{via} (not in the allowed list)"]
        obj = nxt
    return []


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - a module missing here (cutlass on CPU) is screened by name
        return _MISSING


def _getattr(obj: Any, name: str) -> Any:
    try:
        with warnings.catch_warnings():  # deprecated aliases warn when merely looked up
            warnings.simplefilter("ignore")
            return getattr(obj, name)
    except Exception:  # noqa: BLE001 - lazy attributes that fail to load are just unknown
        return _MISSING


def _is_module_path(path: str) -> bool:
    try:
        return importlib.util.find_spec(path) is not None
    except (ImportError, ValueError, AttributeError):
        return False


_MODULE_WHY = {
    "subprocess": "process spawning", "os": "file/OS access", "sys": "interpreter access",
    "socket": "network", "ssl": "network", "http": "network", "urllib": "network",
    "requests": "network", "httpx": "network", "aiohttp": "network", "ftplib": "network",
    "io": "file I/O", "pathlib": "file I/O", "shutil": "file I/O", "tempfile": "file I/O",
    "glob": "file I/O", "mmap": "file I/O", "pickle": "deserialization",
    "marshal": "deserialization", "shelve": "deserialization", "importlib": "dynamic import",
    "builtins": "dynamic code", "runpy": "dynamic code", "code": "dynamic code",
    "codecs": "encoded code", "base64": "encoded code", "ctypes": "native code",
    "cffi": "native code", "threading": "threads", "multiprocessing": "processes",
    "concurrent": "threads", "asyncio": "threads", "signal": "signals", "atexit": "exit hooks",
    "gc": "interpreter introspection", "inspect": "interpreter introspection",
    "traceback": "interpreter introspection", "time": "timers", "timeit": "timers",
    "datetime": "timers", "pty": "process spawning", "random": "not in the allowed list",
}
