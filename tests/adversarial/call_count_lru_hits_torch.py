"""Cheat (telling verification apart), counting through a cache's statistics: an lru_cache'd
helper is called once per call, and its hit count says how many calls there were. Expected:
refused by the static screen (reading cache statistics)."""

from __future__ import annotations

import functools

import torch.nn.functional as F


@functools.lru_cache(maxsize=1)
def _tick(key):
    return key


def run(gate, up, config=None):
    _tick(0)
    if _tick.cache_info().hits <= 1_000_000:
        return (F.silu(gate.float()) * up.float()).to(gate.dtype)
    return F.silu(gate) * up
