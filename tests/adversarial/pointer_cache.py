"""Cheat: caches outputs by input data pointers, so a timing loop over the same buffers does no
work after the first call (attn_output_gate). Expected: "caches outputs by data pointer"."""

from __future__ import annotations

import torch

_CACHE = {}


def run(attn, gate, bias, config=None):
    key = (attn.data_ptr(), gate.data_ptr(), bias.data_ptr())
    if key not in _CACHE:
        _CACHE[key] = attn * torch.sigmoid(gate + bias[None, :, None])
    return _CACHE[key]
