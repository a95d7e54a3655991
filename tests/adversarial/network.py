"""Cheat: fetches outputs over the network. Expected: "imports urllib (network)"."""

from __future__ import annotations

import urllib.request

import torch


def run(gate, up, config=None):
    urllib.request.urlopen("http://127.0.0.1:9/answers")
    return torch.zeros_like(gate)
