"""Operation contracts and the table through which the model calls them.

`CONTRACTS` maps each registry key to its contract (reference, inputs, numerics, cost). The model
never calls a reference directly: it calls `self.ops.<name>(...)` on an `OpTable`, which holds
the implementation chosen for each op (the reference by default, a registry kernel when the
runtime resolves one) and wraps every call in an NVTX range when profiling is switched on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

from . import (
    allreduce_norm_residual_norm,
    attention,
    attn_output_gate,
    gated_o_proj,
    logit_softcap,
    moe_experts,
    norm_residual_norm,
    qk_norm_rope,
    qk_norm_ssmax,
    qkv_gate_proj,
    rmsnorm,
    router,
    swiglu,
)
from ._contract import Cost, Numerics, OpContract

_MODULES = (
    rmsnorm,
    norm_residual_norm,
    qkv_gate_proj,
    qk_norm_rope,
    qk_norm_ssmax,
    attention,
    attn_output_gate,
    gated_o_proj,
    router,
    moe_experts,
    swiglu,
    logit_softcap,
    allreduce_norm_residual_norm,
)
CONTRACTS: dict[str, OpContract] = {m.NAME: OpContract.from_module(m) for m in _MODULES}
OP_NAMES: tuple[str, ...] = tuple(CONTRACTS)

# Switched on by the profiler (autoopt/profiler); off, a range costs one attribute check.
_NVTX = {"enabled": False, "record_function": False}


def set_nvtx(enabled: bool, record_function: bool = False) -> None:
    """Ranges on or off. `record_function` adds torch.profiler ranges of the same names (the
    fallback profiler reads those; it also works on torch builds without NVTX, such as CPU)."""
    _NVTX["enabled"] = enabled
    _NVTX["record_function"] = record_function


def _has_nvtx() -> bool:
    # CPU wheels of torch have no NVTX library: torch.cuda.nvtx raises on every call there.
    if "has_nvtx" not in _NVTX:
        import torch

        _NVTX["has_nvtx"] = hasattr(torch._C, "_nvtx")
    return _NVTX["has_nvtx"]


@contextlib.contextmanager
def region(name: str) -> Iterator[None]:
    """NVTX range (and, when asked, a torch.profiler range) named `name` when profiling is on."""
    if not _NVTX["enabled"]:
        yield
        return
    import torch

    nvtx = _has_nvtx()
    with (torch.profiler.record_function(name) if _NVTX["record_function"]
          else contextlib.nullcontext()):
        if nvtx:
            torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            if nvtx:
                torch.cuda.nvtx.range_pop()


def contract(name: str) -> OpContract:
    try:
        return CONTRACTS[name]
    except KeyError:
        raise ValueError(f"unknown op {name!r}; known ops: {', '.join(OP_NAMES)}") from None


class OpTable:
    """The implementation of every op for one model instance.

    Attribute access (`table.rmsnorm`) returns the selected callable, wrapped in an NVTX range
    named after the op when profiling is on. `sources[name]` says where it came from
    ("reference" or "<variant> (<registry>)"). A composite op without a variant of its own
    (source "reference") is composed from this table's implementations of its parts.
    """

    def __init__(self, impls: Mapping[str, Callable] | None = None,
                 sources: Mapping[str, str] | None = None) -> None:
        self._impls = {name: c.reference for name, c in CONTRACTS.items()}
        self.sources = {name: "reference" for name in CONTRACTS}
        given = set()
        for name, fn in (impls or {}).items():
            contract(name)
            if getattr(fn, "_composed", False):
                continue  # a composite copied from another table: composed again below
            self._impls[name] = fn
            self.sources[name] = (sources or {}).get(name, getattr(fn, "__module__", "custom"))
            given.add(name)
        for name, c in CONTRACTS.items():
            if c.compose is not None and name not in given:
                # No variant for the composite: build it from this table's parts, so a selected
                # kernel of a part keeps running inside it.
                fn = c.compose({p: self._impls[p] for p in c.parts})
                fn._composed = True
                self._impls[name] = fn

    def __getattr__(self, name: str) -> Callable:
        impls = self.__dict__.get("_impls")
        if impls is None or name not in impls:
            raise AttributeError(name)
        fn = impls[name]
        if not _NVTX["enabled"]:
            return fn

        def ranged(*args, **kwargs):
            with region(name):
                return fn(*args, **kwargs)

        return ranged

    def impl(self, name: str) -> Callable:
        contract(name)
        return self._impls[name]


__all__ = ["CONTRACTS", "OP_NAMES", "Cost", "Numerics", "OpContract", "OpTable", "contract",
           "region", "set_nvtx"]
