"""Cheat: a "Triton" variant that reaches torch.compile through a computed object and uses it for
the large shapes. Expected: "static screen: accesses .compile"."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton  # noqa: F401 - looks like a Triton variant

_fast = [torch][0].compile(lambda g, u: (F.silu(g.float()) * u.float()).to(g.dtype))


def run(gate, up, config=None):
    return _fast(gate, up)
