"""Broken: returns the softcapped logits as BF16 instead of FP32. Expected: "wrong dtype/shape"."""

from __future__ import annotations

import torch


def run(logits, cap, config=None):
    return (torch.tanh(logits.float() / cap) * cap).to(torch.bfloat16)
