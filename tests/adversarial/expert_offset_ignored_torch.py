"""Broken for expert parallelism: the reference's formula with the rank's expert offset ignored
(ids are taken as this rank's own; those past its E experts are skipped). Exact on every call a
single-rank model makes, wrong on an EP rank. Expected: rejected at the expert-parallel edge
cases."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def run(x, gate_up, down, weights, ids, scale, expert_offset=0, config=None):
    t, k = ids.shape
    slots = torch.zeros(t, k, x.shape[1], dtype=x.dtype, device=x.device)
    for e in torch.unique(ids).tolist():
        if e >= gate_up.shape[0]:
            continue
        tok, slot = torch.where(ids == e)
        gu = F.linear(x[tok], gate_up[e])
        inter = gu.shape[-1] // 2
        act = (F.silu(gu[:, :inter].float()) * gu[:, inter:].float()).to(x.dtype)
        slots[tok, slot] = F.linear(act, down[e])
    y = (slots * weights.unsqueeze(-1)).sum(dim=1).to(slots.dtype)
    return y * scale
