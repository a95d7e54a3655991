"""The evaluation harness: the only correctness and timing code in the project.

The judge (this process) holds the reference, the policies, the secret and the clocks; the
candidate runs in a worker process that holds only itself and the inputs it is handed.

    verify.py      verify_variant(op, source, ...) -> VerifyReport: screen, plan, judge (run.py)
    screen.py      the static screen: an allowlist of modules, names and attribute chains
    plan.py        the run's secret; shapes from the op contract and the target; the Budget
    session.py     the calls of one verification, in an order drawn from the secret
    trials.py      cases, first calls and their checks; followups.py: repeat, caches, order...
    judgement.py   numerics and near misses per shape and per output (numerics.py: policies)
    channel.py     the judge's handle on a worker; wire.py: messages and the tensor arena
    worker.py      the worker's minimal runner (+ worker_burst.py); audit.py: its audit hook
    races.py       compute-sanitizer racecheck on a GPU
    timing.py      time_callable, time_in_worker, measure_ceilings, floors; bench.py: bench_op
    candidates.py  load a variant file by path (trusted code only: templates, the registry)
    shapes.py      an op's test shapes at given token counts
    guards.py      static_screen (re-exported) and the floor

Names are imported lazily so `import autoopt.eval` stays cheap (no torch).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "VerifyReport": "verify", "verify_variant": "verify", "static_screen": "screen",
    "time_callable": "timing", "Timing": "timing", "bench_op": "bench", "BenchRow": "timing",
    "measure_ceilings": "timing", "Ceilings": "timing", "load_variant": "candidates",
    "Variant": "candidates", "variant_path": "candidates", "default_shapes": "shapes",
    "Budget": "plan",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'autoopt.eval' has no attribute {name!r}")
    return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
