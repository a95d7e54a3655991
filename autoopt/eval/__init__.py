"""The evaluation harness: the only correctness and timing code in the project.

    verify.py      verify_variant(op, source, ...) -> VerifyReport (static screen, then a sandbox
                   child: trials.py runs the behavioural checks, numerics.py the policies)
    guards.py      static screen and behavioural guards (poison, aliasing, mutation, floor)
    sandbox.py     child process with a timeout and an audit hook
    timing.py      time_callable, measure_ceilings, bench_op (job in bench.py)
    candidates.py  load a variant file by path
    shapes.py      default CPU / GPU shapes per op

Names are imported lazily so `import autoopt.eval` stays cheap (no torch).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "VerifyReport": "verify", "verify_variant": "verify", "static_screen": "guards",
    "time_callable": "timing", "Timing": "timing", "bench_op": "timing", "BenchRow": "timing",
    "measure_ceilings": "timing", "Ceilings": "timing", "load_variant": "candidates",
    "Variant": "candidates", "variant_path": "candidates", "default_shapes": "shapes",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'autoopt.eval' has no attribute {name!r}")
    return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
