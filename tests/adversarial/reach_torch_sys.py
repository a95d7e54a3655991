"""Cheat (reaching the judge): finds the reference through a module attribute of torch
(`torch.sys.modules`) and calls it. Expected: "static screen: reaches torch.sys"."""

from __future__ import annotations

import torch


def run(gate, up, config=None):
    ref = torch.sys.modules["model.ops.swiglu"].reference
    return ref(gate, up)
