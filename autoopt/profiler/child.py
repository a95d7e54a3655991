"""The process Nsight Compute profiles: one served step with the sampled ops inside a range.

`python -m autoopt.profiler.child --target T --batch B --layers L --context C --ops a,b` builds
the target's rank (same seed as the parent, so the same weights and routing), serves `batch`
sequences through the engine (the graph's static forward run eagerly, as the parent's labelling
pass runs it), warms up, then runs one step in which every call of the sampled ops sits in the NVTX
range `autoopt_sample` (nsight.SAMPLE_RANGE, outermost, as `autoopt_step` was for whole-step
profiles) with the op's own range inside it (its label); no other range is open. ncu profiles
only kernels inside that range, at most `--launch-count` of them.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from model.ops import CONTRACTS, OpTable

from ..targets import load_target
from .kernel_sets import kernel_set
from .nsight import SAMPLE_RANGE
from .rank import build_rank_model
from .served import ServedStep, ServeShape


def sampled_table(ops: OpTable, names: set[str]) -> OpTable:
    """`ops` with each call of `names` (every op when empty) inside [SAMPLE_RANGE, op name]."""
    def wrap(name: str, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            torch.cuda.nvtx.range_push(SAMPLE_RANGE)
            torch.cuda.nvtx.range_push(name)
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.nvtx.range_pop()
                torch.cuda.nvtx.range_pop()

        return call

    impls = {n: (wrap(n, ops.impl(n)) if not names or n in names else ops.impl(n))
             for n in CONTRACTS}
    return OpTable(impls, ops.sources)


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="One served step with sampled ops (run under ncu).")
    p.add_argument("--target", required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--context", type=int, default=None)
    p.add_argument("--kernels", default="reference")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--registry", default=None)
    p.add_argument("--ops", default="", help="ops to sample (default: every op)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = _args(argv)
    t = load_target(a.target)
    ctx = a.context or t.contexts[0]
    rank = build_rank_model(t, a.layers, seed=a.seed)
    device = rank.model.device
    rank.model.set_ops(kernel_set(a.kernels, device, a.registry).table)
    names = {n for n in a.ops.split(",") if n}
    # With graphs, as the parent: the eager pass below is the graph's forward, capture-safe ops
    # included.
    served = ServedStep(rank.model, ServeShape(t.phase, a.batch, ctx, steps=4), seed=a.seed)
    served.start(a.batch)
    served.step()  # warm-up, outside the range: ncu skips these kernels
    rank.model.set_ops(sampled_table(rank.model.ops, names))  # after capture-safe swaps, if any
    with served.eager():
        served.step()
    print(f"autoopt child: {a.target} batch {a.batch}, {rank.layers} layers: step done")


if __name__ == "__main__":
    main()
