"""Helpers of the qkv_gate_proj templates (`mr`, `splitk`): the packed output's four views and
the argument checks.

Snippet sections, inlined by template.py for `# {{qkv.NAME}}: names` template lines: the format
and the rules are in _common.py's docstring.
"""

from __future__ import annotations

import torch


# {{snippet split}}
def split(out: torch.Tensor, num_heads: int, num_kv_heads: int):
    """(q, k, v, gate) views of the packed output [T, (2Hq + 2Hkv) * D]."""
    t = out.shape[0]
    d = out.shape[1] // (2 * num_heads + 2 * num_kv_heads)
    q, k, v, g = out.split([num_heads * d, num_kv_heads * d, num_kv_heads * d, num_heads * d], -1)
    return (q.view(t, num_heads, d), k.view(t, num_kv_heads, d), v.view(t, num_kv_heads, d),
            g.view(t, num_heads, d))
# {{end}}


# {{snippet check}}
def _check(x: torch.Tensor, weight: torch.Tensor, num_heads: int, num_kv_heads: int) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"qkv_gate_proj expects x[T,H] and weight[N,H]; got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")
    heads = 2 * num_heads + 2 * num_kv_heads
    if num_heads < 1 or num_kv_heads < 1 or weight.shape[0] % heads:
        raise ValueError(f"weight rows {weight.shape[0]} are not (2*{num_heads} + "
                         f"2*{num_kv_heads}) heads of one head_dim")
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        raise ValueError(f"bf16 x and weight expected, got {x.dtype}, {weight.dtype}")
# {{end}}
