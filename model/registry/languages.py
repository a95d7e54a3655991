"""Kernel languages: what a variant is written in, read from its file without importing it.

A variant file may declare, as plain literals at its top level:
    LANGUAGE = "triton"                      # a name registered below; absent: "triton"
    LIBRARY = "flashinfer-python==0.7.0"      # a library it calls, pinned to what was verified
    ARCHS = ("sm_90",)                        # archs it may run on; absent: any
`read_declarations` reads them with `ast` (nothing of the file runs). A language says whether its
variants can run on the CPU, which top-level modules a variant may import (the judge's static
screen reads `imports`), why it cannot run on an arch (toolchain missing, no CPU path), and a
check after import. Adding a language is one class in this file, registered with `@register`;
nothing else in the registry, the runtime or the CLI branches on a language's name.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
import types
from dataclasses import dataclass
from typing import ClassVar, Protocol

from .names import RegistryError, check_arch

DEFAULT_LANGUAGE = "triton"  # files written before languages were declared are Triton
_LIBRARY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9.+!_-]+$")


class Language(Protocol):
    name: ClassVar[str]
    runs_on_cpu: ClassVar[bool]
    imports: ClassVar[tuple[str, ...]]

    def unavailable(self, arch: str) -> str | None:
        """Why this language's variants cannot run on `arch` here (None: they can)."""

    def not_runnable(self, module: types.ModuleType, arch: str) -> str | None:
        """Why an imported variant cannot run on `arch` (None: it can)."""


LANGUAGES: dict[str, Language] = {}


def register(cls: type) -> type:
    LANGUAGES[cls.name] = cls()
    return cls


def language(name: str) -> Language:
    try:
        return LANGUAGES[name]
    except KeyError:
        raise RegistryError(f"unknown kernel language {name!r}; known: "
                            f"{', '.join(sorted(LANGUAGES))}") from None


def _missing(module: str, dist: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return f"{dist} is not installed (pip install {dist})"
    return None


@register
class Triton:
    name = "triton"
    runs_on_cpu = True  # through the interpreter (TRITON_INTERPRET=1)
    imports = ("torch", "triton", "math")

    def unavailable(self, arch: str) -> str | None:
        return _missing("triton", "triton")

    def not_runnable(self, module: types.ModuleType, arch: str) -> str | None:
        jit = sys.modules.get("triton.runtime.jit")
        if arch != "cpu" or jit is None:
            return None
        if any(isinstance(v, jit.JITFunction) for v in vars(module).values()):
            return ("its Triton kernels were compiled for a GPU; on the CPU they need "
                    "TRITON_INTERPRET=1 set before triton is imported")
        return None


@register
class CuTe:
    name = "cute"  # CuTe DSL (nvidia-cutlass-dsl), JIT-compiled for NVIDIA GPUs
    runs_on_cpu = False
    imports = ("torch", "cutlass", "cuda", "math")

    def unavailable(self, arch: str) -> str | None:
        if arch == "cpu":
            return "CuTe DSL variants run on NVIDIA GPUs only"
        return _missing("cutlass", "nvidia-cutlass-dsl")

    def not_runnable(self, module: types.ModuleType, arch: str) -> str | None:
        return None


@register
class Torch:
    name = "torch"  # plain PyTorch, library calls through torch included
    runs_on_cpu = True
    imports = ("torch", "math")

    def unavailable(self, arch: str) -> str | None:
        return None

    def not_runnable(self, module: types.ModuleType, arch: str) -> str | None:
        return None


@register
class Library:
    name = "library"  # a wrapper around a kernel library's call; the file's LIBRARY pins which
    runs_on_cpu = False
    imports = ("torch", "math")  # plus the module of the pinned library

    def unavailable(self, arch: str) -> str | None:
        return "library variants run on GPUs only" if arch == "cpu" else None

    def not_runnable(self, module: types.ModuleType, arch: str) -> str | None:
        return None


@dataclass(frozen=True)
class Declarations:
    """What a variant file says about itself (see the module docstring)."""

    language: str = DEFAULT_LANGUAGE
    library: str | None = None
    archs: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        language(self.language)
        if self.library is not None and not _LIBRARY.match(self.library):
            raise RegistryError(f"LIBRARY = {self.library!r} must pin one version, like "
                                "'flashinfer-python==0.7.0'")
        if self.language == "library" and self.library is None:
            raise RegistryError('LANGUAGE = "library" needs LIBRARY = "<dist>==<version>"')
        for arch in self.archs or ():
            check_arch(arch)

    @property
    def runs_on_cpu(self) -> bool:
        return language(self.language).runs_on_cpu and (self.archs is None or "cpu" in self.archs)


def read_declarations(source: str | bytes, where: str = "<variant>") -> Declarations:
    """LANGUAGE, LIBRARY and ARCHS of a variant's source, read statically."""
    try:
        tree = ast.parse(source, filename=where)
    except SyntaxError as exc:
        raise RegistryError(f"{where} is not valid Python: {exc}") from None
    found: dict[str, object] = {}
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) and node.value else [])
        for t in targets:
            if isinstance(t, ast.Name) and t.id in ("LANGUAGE", "LIBRARY", "ARCHS"):
                try:
                    found[t.id] = ast.literal_eval(node.value)
                except ValueError:
                    raise RegistryError(f"{where}: {t.id} must be a plain literal, read without "
                                        "running the file") from None
    lang, lib, archs = found.get("LANGUAGE", DEFAULT_LANGUAGE), found.get("LIBRARY"), \
        found.get("ARCHS")
    if not isinstance(lang, str) or (lib is not None and not isinstance(lib, str)):
        raise RegistryError(f"{where}: LANGUAGE and LIBRARY must be strings")
    if archs is not None and not (isinstance(archs, list | tuple)
                                  and all(isinstance(a, str) for a in archs)):
        raise RegistryError(f"{where}: ARCHS must be a tuple of arch strings like ('sm_90',)")
    try:
        return Declarations(lang, lib, tuple(archs) if archs is not None else None)
    except RegistryError as exc:
        raise RegistryError(f"{where}: {exc}") from None


def library_problem(spec: str) -> str | None:
    """Why the pinned LIBRARY (`dist==version`) cannot be used here (None: it is installed)."""
    from importlib import metadata

    dist, _, version = spec.partition("==")
    try:
        found = metadata.version(dist)
    except metadata.PackageNotFoundError:
        return f"it calls {spec}, which is not installed (pip install '{spec}')"
    if found != version:
        return f"it was verified with {spec}, this machine has {dist} {found}"
    return None
