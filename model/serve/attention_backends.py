"""`--attention-backend NAME`: which variant of the registry's `attention` op serves.

Attention has one switch, the registry: the runtime's backend (`PagedAttention`) always calls the
`attention` op, and the op's implementation is whatever the model's `OpTable` holds for it. By
default (`auto`) that is the lock's choice for this GPU's arch, like every other op. A name here
overrides that one op, for an experiment or a comparison:

    auto                 the lock (the reference where the lock has no attention entry)
    torch | reference    the op's PyTorch reference (the eager rounding points)
    triton               attention/triton_v1 (split-KV flash decoding, Triton)
    flashinfer           attention/flashinfer_v1 (FlashInfer's paged kernels; CUDA only)
    <variant>            any recorded variant of the op, e.g. agent_0007

A named variant must be recorded (a candidate will do: naming it is the review), match its
record's sha256, have passed verification on this arch and be runnable here: the checks a locked
variant passes. Where it cannot serve, the engine refuses to start and says why, instead of
silently running something else.
"""

from __future__ import annotations

import re

import torch

from ..ops import OP_NAMES, OpTable, contract
from ..registry import Registry
from ..registry.runtime import load_recorded

OP = "attention"
BACKENDS: dict[str, str | None] = {
    "auto": None,
    "torch": "reference",
    "reference": "reference",
    "triton": "triton_v1",
    "flashinfer": "flashinfer_v1",
}
_VARIANT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def check_name(name: str) -> str:
    """A valid --attention-backend value (a known name or a variant identifier)."""
    if name not in BACKENDS and not _VARIANT.match(name or ""):
        raise ValueError(f"attention backend {name!r} is not one of {sorted(BACKENDS)} or a "
                         "variant name of the attention op")
    return name


def with_impl(ops: OpTable, op: str, fn, source: str) -> OpTable:
    """A copy of `ops` with `op` implemented by `fn` (what the registry attached kept)."""
    impls = {name: ops.impl(name) for name in OP_NAMES}
    impls[op] = fn
    table = OpTable(impls, {**ops.sources, op: source})
    for key, value in vars(ops).items():
        if key not in ("_impls", "sources"):
            setattr(table, key, value)
    return table


def select(name: str, ops: OpTable, device: torch.device, dtype: torch.dtype,
           registry: str | None = None) -> tuple[OpTable, str]:
    """(the OpTable to serve with, a note saying which attention runs and why)."""
    variant = BACKENDS.get(check_name(name), name)
    if variant is None:
        return ops, f"attention: {ops.sources.get(OP, 'reference')} (the lock)"
    if variant == "reference":
        return with_impl(ops, OP, contract(OP).reference, "reference"), \
            f"attention: reference (--attention-backend {name})"
    if dtype != torch.bfloat16:
        call, why = None, f"registry variants implement the BF16 contract, the model runs {dtype}"
    else:
        call, why = load_recorded(Registry(registry), OP, variant, device)
    if call is None:
        raise ValueError(f"attention backend {name!r} ({OP}/{variant}) cannot serve here: {why}; "
                         "use --attention-backend auto (the lock) or torch")
    return with_impl(ops, OP, call, call.source), \
        f"attention: {variant} (--attention-backend {name})"

