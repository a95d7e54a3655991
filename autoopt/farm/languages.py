"""What a submission's kernel language needs before the judge runs it, by language name.

A submission declares its language (the file's `LANGUAGE`, read statically by the registry's
`read_declarations`; absent means Triton). Triton compiles on its first launch inside the judge,
so its compile errors are the judge's "raised" findings. A CuTe DSL variant is compiled first by
the registry's own check (`model.registry.cute.check_compiles`: its `precompile(arch)` in a child
process with `CUTE_DSL_ARCH`), so a compiler error comes back as such before anything runs; on
a machine without a GPU it cannot run at all, which the verdict says after the compile result.
Adding a language is one function registered in `PRECHECKS`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

DEFAULT_ARCH = "sm_90"  # what a CPU worker compiles CuTe for: the targets' GPUs are Hopper


def _triton(path: Path, device: str) -> list[str]:
    return []  # compiled at the first launch, inside the judge's worker


def _arch(device: str) -> str:
    if not device.startswith("cuda"):
        return DEFAULT_ARCH
    from model.registry import current_arch

    return current_arch(device)


def _cute(path: Path, device: str) -> list[str]:
    from model.registry import cute
    from model.registry.languages import language

    arch = _arch(device)
    errors = cute.check_compiles(path, arch)
    if errors:
        return [f"CuTe DSL compile for {cute.dsl_arch(arch)} failed: {e}" for e in errors]
    if not device.startswith("cuda"):
        return [f"compiles for {cute.dsl_arch(arch)}, but not verified: "
                f"{language('cute').unavailable('cpu')} and this worker has none"]
    return []


PRECHECKS: dict[str, Callable[[Path, str], list[str]]] = {"triton": _triton, "cute": _cute}


def precheck(language: str, path: Path, device: str) -> list[str]:
    """Errors that stop `path` before the judge (empty: go on), by its declared language."""
    try:
        check = PRECHECKS[language]
    except KeyError:
        return [f"LANGUAGE = {language!r} cannot be submitted; submit one of "
                f"{', '.join(sorted(PRECHECKS))}"]
    return check(path, device)


def declared(source: str) -> tuple[str | None, str | None]:
    """(the source's declared language, None) or (None, why it cannot be read)."""
    from model.registry import RegistryError, read_declarations

    try:
        return read_declarations(source, "<submission>").language, None
    except RegistryError as exc:
        return None, str(exc)


__all__ = ["PRECHECKS", "declared", "precheck"]
