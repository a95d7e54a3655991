"""attention(q[T,Hq,D], k[S,Hkv,D], v[S,Hkv,D], q_pos[T], k_pos[S], window, scale) -> [T,Hq,D]

One sequence's causal GQA attention; key j is visible to query i when k_pos[j] <= q_pos[i] and,
for sliding-window layers (window > 0), q_pos[i] - k_pos[j] < window (window keys including
itself). The reference is transformers' *eager* path, pinned for golden outputs: BF16 scores
bf(q.k), scaled in BF16, masked, FP32 softmax rounded to BF16, BF16 P.V. Flash-style kernels never
match it bitwise (NUMERICS.md "Attention"), so the policy is a loose ulp bound.
"""

from __future__ import annotations

import torch

from ._contract import Cost, Numerics, Shape, gen, randn

NAME = "attention"
SIGNATURE = (
    "attention(q[T,Hq,D] bf16, k[S,Hkv,D] bf16, v[S,Hkv,D] bf16, q_pos[T] int64, k_pos[S] int64, "
    "window: int (0 = full), scale: float) -> [T,Hq,D] bf16"
)
AXES = {
    "T": "query tokens",
    "S": "keys (context)",
    "Hq": "query heads/rank",
    "Hkv": "KV heads/rank",
}

# Test shapes (model/ops/_contract.py "Test shapes"): see `test_shapes` below.
CPU_DIMS = {"Hq": 6, "Hkv": 1, "D": 128}
CPU_FREE_DIMS = {"Hq": (1, 12)}
TOKEN_RANGE = {"cpu": (1, 64)}
EDGE_SCALES = {"tiny": {0: 2.0**-40}, "huge": {0: 2.0**4}}
GPU_MIN_CONTEXT = 4096


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[T, S] bool: which keys each query may attend."""
    dist = q_pos[:, None] - k_pos[None, :]
    ok = dist >= 0
    if window:
        ok &= dist < window
    return ok


def reference(q, k, v, q_pos, k_pos, window: int, scale: float) -> torch.Tensor:
    n_rep = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D]
    kh = k.transpose(0, 1).repeat_interleave(n_rep, dim=0).unsqueeze(0)  # [1, Hq, S, D]
    vh = v.transpose(0, 1).repeat_interleave(n_rep, dim=0).unsqueeze(0)
    scores = torch.matmul(qh, kh.transpose(2, 3)) * scale
    mask = torch.zeros(q.shape[0], k.shape[0], dtype=q.dtype, device=q.device)
    mask.masked_fill_(~visible(q_pos, k_pos, window), torch.finfo(q.dtype).min)
    probs = torch.softmax(scores + mask, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, vh)[0].transpose(0, 1).contiguous()


NUMERICS = Numerics(
    kind="ulp",
    max_ulp=4,
    max_mismatch_fraction=0.25,
    near_misses={},
    note="Never bitwise: eager rounds scores to BF16, flash does not. Bound to calibrate on GPU.",
)


def make_inputs(shape: Shape, seed: int, device="cpu", dtype=torch.bfloat16) -> tuple:
    g = gen(seed)
    t, s, hq, hkv, d = shape["T"], shape["S"], shape["Hq"], shape["Hkv"], shape["D"]
    q = randn((t, hq, d), g, dtype, device)
    k = randn((s, hkv, d), g, dtype, device)
    v = randn((s, hkv, d), g, dtype, device)
    k_pos = torch.arange(s, device=device)
    q_pos = k_pos[s - t :].clone()
    return q, k, v, q_pos, k_pos, int(shape.get("W", 0)), d**-0.5


def cost(shape: Shape) -> Cost:
    t, s, hq, hkv, d = shape["T"], shape["S"], shape["Hq"], shape["Hkv"], shape["D"]
    keys = min(s, shape.get("W", 0) or s)
    return Cost(bytes=2 * (2 * t * hq * d + 2 * keys * hkv * d), flops=4 * t * keys * hq * d)


def shapes_for(cfg, tokens: int, shard=None, context: int | None = None, layer: int = 0):
    hq = shard.num_attention_heads if shard else cfg.num_attention_heads
    hkv = shard.num_key_value_heads if shard else cfg.num_key_value_heads
    window = cfg.window(layer) or 0
    return {
        "T": tokens,
        "S": context or tokens,
        "Hq": hq,
        "Hkv": hkv,
        "D": cfg.head_dim,
        "W": window,
    }


def test_shapes(cfg, shard, tokens: int, kind: str) -> list[dict[str, int]]:
    """Full and sliding-window attention over a context longer than the query chunk."""
    if kind == "cpu":
        return [{"T": tokens, "S": tokens + 37, "W": w, **CPU_DIMS} for w in (0, 16)]
    layers = range(cfg.num_hidden_layers)
    full = next((i for i in layers if cfg.window(i) is None), 0)
    slide = next((i for i in layers if cfg.window(i) is not None), None)
    ctx = max(GPU_MIN_CONTEXT, tokens)
    out = [shapes_for(cfg, tokens, shard, context=ctx, layer=full)]
    if slide is not None:
        out.append(shapes_for(cfg, tokens, shard, context=ctx, layer=slide))
    return out
