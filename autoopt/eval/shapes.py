"""Shapes at given token counts, from the op contracts' own test shapes.

Each op contract declares what it is tested at (`model/ops/_contract.py` "Test shapes"); this
module only applies that to token counts: `cpu_shapes` (the op's CPU widths), `gpu_shapes` (a
preset at a TP degree, or a target's layout) and `default_shapes` (on CPU the cpu-tiny target's
buckets, on a GPU the targets for the local GPU). The verifier plans its own shapes
(plan.py); these helpers serve callers that name token counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def cpu_shapes(op: str, tokens: Sequence[int] | None = None) -> list[dict[str, int]]:
    from model.ops import contract

    from .plan import default_targets

    tests = contract(op).tests
    if tokens is None:
        t = default_targets("cpu")[0]
        tokens = sorted({t.tokens(b) for b in t.batch_sizes})
    return [s for n in tokens for s in tests.at(None, None, n, "cpu")]


def gpu_shapes(op: str, tokens: Sequence[int], *, preset: str = "beam-1.0-501b", tp: int = 8,
               ep: int = 1) -> list[dict[str, int]]:
    """The op's GPU test shapes of `preset` at TP `tp` (per rank) for each token count."""
    from model.config import preset as get_preset
    from model.ops import contract

    cfg = get_preset(preset)
    shard = cfg.shard(tp, ep)
    return [s for n in tokens for s in contract(op).tests.at(cfg, shard, n, "gpu")]


def target_shapes(op: str, targets: Sequence[Any], tokens: Sequence[int] | None = None
                  ) -> list[dict[str, int]]:
    """The op's test shapes at each target's layout, at `tokens` or the target's buckets."""
    from model.ops import contract

    tests = contract(op).tests
    out: list[dict[str, int]] = []
    for t in targets:
        kind = "cpu" if t.hardware.is_cpu else "gpu"
        cfg, shard = (None, None) if kind == "cpu" else (t.config(), t.shard)
        for n in tokens or sorted({t.tokens(b) for b in t.batch_sizes}):
            out += [s for s in tests.at(cfg, shard, n, kind) if s not in out]
    return out


def default_shapes(op: str, device: str, tokens: Sequence[int] | None = None) -> list[dict]:
    from .plan import default_targets

    if device.startswith("cuda"):
        return target_shapes(op, default_targets(device), tokens)
    return cpu_shapes(op, tokens)
