"""Broken: never returns. Expected: "timeout"."""

from __future__ import annotations


def run(gate, up, config=None):
    n = 0
    while True:
        n += 1
