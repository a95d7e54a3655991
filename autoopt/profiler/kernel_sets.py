"""Kernel sets a step can run with: `reference`, `tuned`, `compile`, or a registry lock file.

- `reference`: every op's plain PyTorch reference.
- `reference-graphs`: the reference set as a server can replay it from CUDA graphs: every op's
  reference except those that cannot be captured (`moe_experts`), which run their recorded
  library stand-in where the registry has it for this arch (as in `compile`, below); the
  baseline of the optimize loop's end-to-end check on a GPU.
- `tuned`: the registry's lock for this machine's arch (model/registry.py resolves it).
- `compile`: the peer a user would reach for: every op's reference under `torch.compile`
  (Inductor, with `emulate_precision_casts` so it keeps the reference's BF16 roundings, hence
  the same function), captured in the same CUDA graphs. `moe_experts`' reference syncs with the
  host (it loops over the experts present) and cannot be captured: where the registry has
  `moe_experts/grouped_mm_v2` verified for this arch (torch's own grouped GEMM, the library
  path a PyTorch user has), the set runs it, so that the step replays from a graph like the
  others; elsewhere the reference, eagerly. The set's notes say which. Each op compiles once per
  distinct argument kind: the layers share the ops, so 52 layers do not mean 52 compiles.
- `tuned+compile`: the lock's variants, and every op the lock leaves at the reference under
  `torch.compile` as in `compile`: what `autoopt serve --kernels tuned+compile` runs
  (torch.compile beats a set whose unlocked ops run eagerly).
- anything else: the path of a lock file (e.g. a "before" lock for comparisons).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from model.ops import CONTRACTS, OpTable
from model.ops.compiled import NOT_COMPILED, compile_reference
from model.ops.compiled import SOURCE as COMPILED

from ..targets import TargetError

# What the compile set runs for an op it does not compile, where the registry can load it.
LIBRARY_STANDIN = {"moe_experts": "grouped_mm_v2"}


@dataclass(frozen=True)
class KernelSet:
    name: str  # as given on the command line
    table: OpTable = field(compare=False)
    notes: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """Short name for tables: a lock path shows as its file name."""
        return self.name if self.name in BUILDERS else f"lock:{Path(self.name).name}"


def _reference(_name: str, _device: torch.device, _registry: str | None) -> KernelSet:
    return KernelSet("reference", OpTable())


def _reference_graphs(name: str, device: torch.device, registry: str | None) -> KernelSet:
    impls, sources, notes = {}, {}, []
    for op, variant in LIBRARY_STANDIN.items():
        call, refused = _standin(op, device, registry)
        if call is None:
            notes.append(f"{name}: {op} has no capturable stand-in here; runs its reference "
                         "eagerly" + (f" ({refused})" if refused else ""))
            continue
        impls[op], sources[op] = call, call.source
        notes.append(f"{name}: {op} runs {op}/{variant}, the library path, so the step can be "
                     "captured; every other op its reference")
    return KernelSet(name, OpTable(impls, sources), tuple(notes))


def _registry_set(name: str, device: torch.device, registry: str | None) -> KernelSet:
    try:
        from model.registry import resolve_ops
    except ImportError as e:  # pragma: no cover - the registry ships with the model package
        raise TargetError(f"--kernels {name} needs the kernel registry ({e})") from None
    base = name.removesuffix("+compile")
    if base != "tuned" and not Path(base).is_file():
        raise TargetError(f"--kernels: {name!r} is not reference, reference-graphs, tuned, "
                          "compile, tuned+compile or a lock file path (LOCK+compile compiles "
                          "what it leaves)")
    # A lock file given by path (the optimize loop's trial of a run's new set) may select
    # verified candidates: measuring them is the point; serving never loads them.
    table = resolve_ops(kernels=name, registry=registry, device=device, dtype=torch.bfloat16,
                        allow_candidates=base != "tuned")
    refused = {op: r.refused for op, r in getattr(table, "resolution", {}).items() if r.refused}
    used = sorted(op for op, s in table.sources.items()
                  if s not in ("reference", COMPILED))
    notes = [f"{name}: registry variants for {', '.join(used) or 'no op'}"]
    notes += [f"{name}: {op} refused ({why}); runs the reference" for op, why in refused.items()]
    return KernelSet(name, table, tuple(notes))


def _compile(_name: str, device: torch.device, registry: str | None) -> KernelSet:
    impls = {op: compile_reference(c.reference) for op, c in CONTRACTS.items()
             if op not in NOT_COMPILED}
    sources = dict.fromkeys(impls, COMPILED)
    notes = []
    for op, why in NOT_COMPILED.items():
        call, refused = _standin(op, device, registry)
        if call is None:
            notes.append(f"compile: {op} not compiled ({why}); runs the reference eagerly"
                         + (f" ({refused})" if refused else ""))
            continue
        impls[op], sources[op] = call, call.source
        notes.append(f"compile: {op} not compiled ({why}); runs {op}/{LIBRARY_STANDIN[op]}, "
                     "the library path, so the step can be captured")
    notes.append("compile: each op's reference compiled by Inductor with emulate_precision_casts; "
                 "GEMMs outside the ops and the attention backend are as in the reference set")
    return KernelSet("compile", OpTable(impls, sources), tuple(notes))


def _tuned_compile(name: str, device: torch.device, registry: str | None) -> KernelSet:
    # Exactly what `autoopt serve --kernels tuned+compile` runs: resolve_ops compiles what the
    # lock leaves at the reference (an unlocked moe_experts stays the eager reference there too).
    base = _registry_set(name, device, registry)
    compiled = sorted(op for op, src in base.table.sources.items() if src == COMPILED)
    return KernelSet(name, base.table, (*base.notes, f"{name}: compiled by Inductor where the "
                                        f"lock has no variant: {', '.join(compiled) or 'no op'}"))


def _standin(op: str, device: torch.device, registry: str | None):
    """(the recorded library variant that stands in for `op`, None) or (None, why not)."""
    variant = LIBRARY_STANDIN.get(op)
    if variant is None:
        return None, None
    from model.registry import Registry
    from model.registry.runtime import load_recorded

    try:
        return load_recorded(Registry(registry), op, variant, device)
    except Exception as e:  # noqa: BLE001 - a registry that cannot load it leaves the reference
        return None, f"{type(e).__name__}: {e}"


BUILDERS: dict[str, Callable[[str, torch.device, str | None], KernelSet]] = {
    "reference": _reference, "reference-graphs": _reference_graphs, "tuned": _registry_set,
    "compile": _compile, "tuned+compile": _tuned_compile}


def kernel_set(name: str, device: torch.device, registry: str | Path | None = None) -> KernelSet:
    """The named set's op table for `device` (a lock path resolves like `tuned`)."""
    build = BUILDERS.get(name, _registry_set)
    return build(name, device, str(registry) if registry is not None else None)


def parse_sets(text: str | None, default: tuple[str, ...]) -> tuple[str, ...]:
    """'reference,tuned,locks/before.toml' -> its names, in order, without repeats."""
    names = [s.strip() for s in (text or "").split(",") if s.strip()] or list(default)
    return tuple(dict.fromkeys(names))


__all__ = ["BUILDERS", "KernelSet", "NOT_COMPILED", "compile_reference", "kernel_set",
           "parse_sets"]
