"""Cheat: runs a process (to fetch answers or tamper with the GPU clocks).
Expected: "imports subprocess"."""

from __future__ import annotations

import subprocess

import torch


def run(gate, up, config=None):
    subprocess.run(["nvidia-smi", "-lgc", "2000"], check=False)
    return torch.zeros_like(gate)
