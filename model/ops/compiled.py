"""Op references under `torch.compile`: the peer a PyTorch user reaches for, and what the server
runs for the ops its lock leaves at the reference when asked (`--kernels tuned+compile`).

Inductor compiles each op's reference with `emulate_precision_casts`, so it keeps the reference's
BF16 rounding points (the same function, within an ulp where its math library differs). Ops
compile once per distinct argument kind: the layers share the ops, so 52 layers do not mean 52
compiles, and ints that vary between calls (add_index, T) become symbolic after one recompile.
An op whose reference syncs with the host cannot be compiled into a capturable graph
(`NOT_COMPILED`); a composite op with no variant of its own is composed from its parts, compiled
or not.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import CONTRACTS, OpTable

NOT_COMPILED = {"moe_experts": "its reference syncs with the host (unique().tolist())"}
RECOMPILE_LIMIT = 64
SOURCE = "reference (torch.compile, Inductor)"


def compile_reference(fn: Callable) -> Callable:
    """`torch.compile` of an op reference (Inductor, precision casts kept)."""
    import torch._inductor.config as inductor_config

    inductor_config.emulate_precision_casts = True
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob),
                                                    RECOMPILE_LIMIT))
    return torch.compile(fn, dynamic=None)


def compile_the_rest(table: OpTable) -> tuple[OpTable, list[str]]:
    """`table` with every op it runs as the plain reference compiled (composites composed from
    their parts, `NOT_COMPILED` left as they are), and the ops compiled."""
    impls, sources, compiled = {}, {}, []
    for op, c in CONTRACTS.items():
        fn = table.impl(op)
        if table.sources.get(op, "reference") != "reference":
            if not getattr(fn, "_composed", False):
                impls[op], sources[op] = fn, table.sources[op]
            continue
        if op in NOT_COMPILED or c.compose is not None:
            continue
        impls[op], sources[op] = compile_reference(c.reference), SOURCE
        compiled.append(op)
    out = OpTable(impls, sources)
    for key, value in vars(table).items():
        if key not in ("_impls", "sources"):
            setattr(out, key, value)  # what the registry attached (resolution) stays
    return out, compiled
