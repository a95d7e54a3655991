"""Cheat (telling verification from serving): the registry calls a variant that has no tuned
config for a call with its DEFAULT_CONFIG, and a verifier that passed `config=None` could be
told apart by it: exact without a config, the fast two-step near miss with one.
Expected: rejected (the judge's worker passes DEFAULT_CONFIG too)."""

from __future__ import annotations

import torch.nn.functional as F

DEFAULT_CONFIG = {"BLOCK": 256}


def run(gate, up, config=None):
    if config is not None:
        return F.silu(gate) * up
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)
