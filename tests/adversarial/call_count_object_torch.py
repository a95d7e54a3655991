"""Cheat (telling verification apart), counting in an object's attribute: `run` is a bound method
whose object counts its calls through `self` (no module-level name is touched). Exact for a
million calls. Expected: rejected because its state changes from call to call."""

from __future__ import annotations

import torch.nn.functional as F


class _Kernel:
    calls = 0

    def go(self, gate, up, config=None):
        self.calls += 1
        if self.calls <= 1_000_000:
            return (F.silu(gate.float()) * up.float()).to(gate.dtype)
        return F.silu(gate) * up


run = _Kernel().go
