"""Cheat (reaching the judge): runs hex-encoded code that imports the reference.
Expected: "static screen: uses exec"."""

from __future__ import annotations

import torch

_CODE = bytes.fromhex("66726f6d206d6f64656c2e6f70732e7377696775206d706f7274207265666572656e6365")


def run(gate, up, config=None):
    scope = {}
    exec(_CODE.decode(), scope)
    return scope.get("reference", lambda g, u: torch.zeros_like(g))(gate, up)
