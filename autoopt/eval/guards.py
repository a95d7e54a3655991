"""Guards that are not a call's behaviour: the static screen (screen.py) and the floor.

The behavioural guards (poison, aliasing, mutation, caches, determinism, order, outputs that
must stay put) live with the calls they judge, in trials.py and followups.py.
"""

from __future__ import annotations

from .screen import ALLOWED_IMPORTS, ALLOWED_MODULES, static_screen

__all__ = ["ALLOWED_IMPORTS", "ALLOWED_MODULES", "FLOOR_MARGIN", "floor_violation",
           "static_screen"]

# A measured copy kernel is the bandwidth ceiling; a faster op is impossible.
# Measured copy bandwidth is ~0.9 of HBM peak on an H200 (4.26 vs 4.8 TB/s): only a time under
# 0.8 x the measured floor is beyond what the hardware can do, whatever the copy test missed.
FLOOR_MARGIN = 0.8


def floor_violation(median_us: float, floor_us: float, margin: float = FLOOR_MARGIN) -> str | None:
    if floor_us > 0 and median_us < floor_us * margin:
        return (f"faster than the floor: {median_us:.2f} us < {margin:g} x floor {floor_us:.2f} us "
                f"(bytes / measured bandwidth): impossible, the timing or the kernel is wrong")
    return None
