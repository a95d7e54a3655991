"""Race (torch): scatters every row twice with index_put_ - first a near-miss value, then the exact
one. torch leaves duplicate indices undefined; on CPU the writes run in order and the exact value
wins, on a GPU the writes race.
Expected on CPU: races "not checked (no GPU)" (it may pass there); on a GPU: rejected when the
race shows (wrong or nondeterministic outputs)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def run(gate, up, config=None):
    t = gate.shape[0]
    exact = (F.silu(gate.float()) * up.float()).to(gate.dtype)
    idx = torch.cat([torch.arange(t), torch.arange(t)]).to(gate.device)
    out = torch.empty_like(gate)
    out.index_put_((idx,), torch.cat([F.silu(gate) * up, exact]))
    return out
