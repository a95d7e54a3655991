"""Cheat: writes only the first half of the vocabulary of the softcapped logits (logit_softcap).
Expected: "not written (NaN poison survived)"."""

from __future__ import annotations

import torch


def run(logits, cap, config=None):
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    half = logits.shape[1] // 2
    out[:, :half] = torch.tanh(logits[:, :half].float() / cap) * cap
    return out
