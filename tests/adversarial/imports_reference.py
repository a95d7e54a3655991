"""Cheat: calls the reference. Expected: "static screen: imports the reference"."""

from __future__ import annotations

from model.ops.swiglu import reference


def run(gate, up, config=None):
    return reference(gate, up)
