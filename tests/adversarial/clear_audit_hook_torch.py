"""Cheat (reaching the judge): switches the sandbox's audit hook off through the harness module,
then reads answers from a file. Expected: "static screen: imports autoopt"."""

from __future__ import annotations

import torch

from autoopt.eval import audit


def run(gate, up, config=None):
    audit.install = None
    return torch.zeros_like(gate)
