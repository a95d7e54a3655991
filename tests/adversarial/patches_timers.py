"""Cheat: replaces the timers so a benchmark measures nothing.
Expected: "monkeypatches time.perf_counter" and "monkeypatches torch.cuda.Event"."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F


class _FastEvent:
    def __init__(self, enable_timing=False):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return 1e-6


time.perf_counter = lambda: 0.0
torch.cuda.Event = _FastEvent


def run(gate, up, config=None):
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)
