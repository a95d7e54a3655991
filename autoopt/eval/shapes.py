"""Default verification and benchmark shapes per op.

CPU shapes are small (Triton kernels run through the interpreter there) with odd token counts
(1, 17, 123) and reduced widths (hidden 320 instead of 5120), keeping every structural feature:
GQA heads, head_dim 128, the router's 8 groups of 32 experts. GPU shapes are the real Beam-1.0
per-rank shapes at TP8 (`preset("beam-1.0-501b").shard(8)` through each op's `shapes_for`), so
the kernels are verified at the sizes they will run.
"""

from __future__ import annotations

from collections.abc import Sequence

CPU_TOKENS = (1, 17, 123)
GPU_TOKENS = (1, 17, 128, 515)
GPU_PRESET = "beam-1.0-501b"
GPU_TP = 8

# Widths for CPU: per op, the fixed (non-token) dimensions.
_CPU_DIMS: dict[str, dict[str, int]] = {
    "rmsnorm": {"H": 320},
    "norm_residual_norm": {"H": 320},
    "allreduce_norm_residual_norm": {"H": 320},
    "swiglu": {"I": 320},
    "attn_output_gate": {"Hq": 6, "D": 128},
    "logit_softcap": {"V": 997},
    "qk_norm_rope": {"Hq": 6, "Hkv": 1, "D": 128},
    "qk_norm_ssmax": {"Hq": 6, "Hkv": 1, "D": 128},
    "qkv_gate_proj": {"H": 320, "Hq": 6, "Hkv": 1, "D": 128},
    "router": {"H": 320, "E": 256, "n_group": 8, "topk_group": 4, "top_k": 8},
    "moe_experts": {"H": 320, "E": 16, "I": 64, "k": 8},
    "attention": {"Hq": 6, "Hkv": 1, "D": 128},
}


def cpu_shapes(op: str, tokens: Sequence[int] = CPU_TOKENS) -> list[dict[str, int]]:
    if op not in _CPU_DIMS:
        raise ValueError(f"no default CPU shapes for op {op!r}; known: {', '.join(_CPU_DIMS)}")
    dims = _CPU_DIMS[op]
    if op == "attention":
        # Decode rows (one query per sequence) against longer contexts, and prefill chunks of
        # a few sequences; full and sliding-window; pages of 4 so rows cross page edges.
        out = []
        for i, t in enumerate(tokens):
            b = t if i % 2 == 0 else max(1, t // 8)
            out.append({"T": t, "B": b, "S": 37 + -(-t // b), "W": 16 if i % 2 else 0,
                        "page": 4, **dims})
        return out
    if op in ("qk_norm_rope", "qk_norm_ssmax"):
        return [{"T": t, "page": 4, **dims} for t in tokens]
    if op == "allreduce_norm_residual_norm":
        # Two ranks (a rounded pair sum) and more (where the per-step rounding near miss shows).
        return [{"R": (2, 3, 8)[i % 3], "T": t, **dims} for i, t in enumerate(tokens)]
    if op == "moe_experts":
        return [{"T": t, **dims} for t in tokens if t <= 17] or [{"T": 1, **dims}]
    return [{"T": t, **dims} for t in tokens]


def gpu_shapes(op: str, tokens: Sequence[int] = GPU_TOKENS, *, preset: str = GPU_PRESET,
               tp: int = GPU_TP, context: int = 4096) -> list[dict[str, int]]:
    """Real per-rank shapes of `preset` at tensor parallelism `tp`."""
    from model.config import preset as get_preset
    from model.ops import contract

    cfg = get_preset(preset)
    shard = cfg.shard(tp)
    c = contract(op)
    if op == "attention":
        return [dict(c.shapes_for(cfg, t, shard, context=max(context, t))) for t in tokens]
    return [dict(c.shapes_for(cfg, t, shard)) for t in tokens]


def default_shapes(op: str, device: str, tokens: Sequence[int] | None = None) -> list[dict]:
    if device.startswith("cuda"):
        return gpu_shapes(op, tokens or GPU_TOKENS)
    return cpu_shapes(op, tokens or CPU_TOKENS)
