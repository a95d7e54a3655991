"""One rank of a target, built where it runs: Beam at the target's per-rank shapes.

`build_rank_model` makes the model directly on the device with random weights (filled there:
the 52-layer TP8 rank of Beam is ~124 GB in BF16, which a host-side fill would take minutes to
make and copy), or loads a checkpoint's rank-0 slices with `model_path`. Under TP the rank's
collectives are simulated by `OneRankGroup`: every gather returns R copies of this rank's tensor,
so the rank computes exactly what it computes in a TP group (the all-gathered partials go through
`allreduce_norm_residual_norm`, the vocabulary gather builds the full logits) without its peers;
the time on the interconnect is not part of the step measured.

Sizing: `plan_layers` says how many layers fit the free memory with the KV cache the step needs
(all of them for the shipped TP8 targets; a stated proxy layer count for TP2).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from model.beam import BeamForCausalLM
from model.parallel import TPGroup, attach

from ..targets import Target, TargetError

_GIB = 1 << 30


class OneRankGroup(TPGroup):
    """Rank 0 of a TP group of `size` whose peers are stand-ins: each gather returns `size`
    copies of this rank's tensor (the bytes an all-gather lands, without the interconnect)."""

    def gather_partials(self, t: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return t.unsqueeze(0)
        return t.unsqueeze(0).expand(self.size, *t.shape).contiguous()


def attach_rank(model: BeamForCausalLM) -> str | None:
    """Give a TP rank's model its (simulated) collectives; returns the note saying so."""
    tp = model.shard.tp
    if tp == 1:
        return None
    attach(model, OneRankGroup(0, tp, "local", model.device))
    return (f"TP{tp} rank 0 on one device: the rank's collectives gather {tp} copies of its own "
            "partials (its compute, including allreduce_norm_residual_norm, is the rank's; the "
            "interconnect's time is not measured)")


# ---- sizing ------------------------------------------------------------------------------------
def weight_bytes(target: Target, layers: int) -> int:
    """Bytes of one rank's weights at `layers` layers (built on the meta device)."""
    with torch.device("meta"):
        m = BeamForCausalLM(target.config(layers), target.shard)
    return sum(b.numel() * b.element_size() for b in m.buffers())


def kv_token_bytes(target: Target, layers: int | None = None) -> tuple[int, int, int]:
    """(bytes of one token's K+V in one layer, full-attention layers, sliding layers)."""
    cfg, shard = target.config(layers), target.shard
    per_layer = 2 * shard.num_key_value_heads * cfg.head_dim * 2  # K and V, BF16
    n_slide = cfg.num_sliding_layers
    return per_layer, cfg.num_hidden_layers - n_slide, n_slide


def kv_bytes(target: Target, batch: int, context: int, layers: int) -> int:
    """KV bytes `batch` sequences of `context` tokens hold (sliding layers keep one window)."""
    cfg = target.config(layers)
    per_layer, n_full, n_slide = kv_token_bytes(target, layers)
    window = min(context, (cfg.sliding_window or context) + 2 * 16)  # + straddled pages
    return per_layer * (n_full * context + n_slide * window) * batch


def activation_bytes(target: Target, batch: int, context: int) -> int:
    """A generous bound on one step's live activations (the reference MoE holds [T, k, H] FP32;
    the torch decode attention gathers every sequence's keys)."""
    cfg, shard = target.config(), target.shard
    t = target.tokens(batch, context)
    moe = 6 * t * cfg.num_experts_per_tok * cfg.hidden_size
    if target.phase == "decode":
        attn = 12 * batch * context * shard.num_attention_heads * 4 + \
            4 * batch * context * shard.num_key_value_heads * cfg.head_dim
    else:
        attn = 12 * context * context * shard.num_attention_heads
    return moe + attn + 8 * batch * shard.vocab_size * target.tp + 2 * _GIB


def plan_layers(target: Target, batch: int, context: int, free_bytes: int,
                layers: int | None = None) -> tuple[int, str]:
    """Layer count to build and why: the requested/target count, or the most that fit."""
    want = layers or target.default_layers
    # 1 GiB for the CUDA context's growth, cuBLAS workspaces and allocator rounding.
    budget = free_bytes - activation_bytes(target, batch, context) - _GIB

    def need(n: int) -> int:
        return weight_bytes(target, n) + kv_bytes(target, batch, context, n)

    if layers is not None or need(want) <= budget:
        why = "requested" if layers is not None else "fits"
        return want, f"{want} layers ({why}; {need(want) / 1e9:.1f} GB of weights + KV)"
    n = want
    while n > 4 and need(n) > budget:
        n -= 1
    if need(n) > budget:
        raise TargetError(f"{target.name}: even {n} layers need {need(n) / 1e9:.1f} GB and "
                          f"{budget / 1e9:.1f} GB are free; lower --batch or --context")
    return n, (f"{n} of {want} layers: {want} need {need(want) / 1e9:.1f} GB of weights + KV, "
               f"{free_bytes / 1e9:.1f} GB free")


# ---- building ------------------------------------------------------------------------------------
def fill_random(model: BeamForCausalLM, gen: torch.Generator) -> None:
    """Random weights in place, on the model's device: norm weights around 1, projections scaled
    by fan-in^-0.5 (so activations keep their scale and routing spreads over the experts)."""
    for name, buf in model.named_buffers():
        leaf = name.rsplit(".", 1)[-1]
        if leaf.endswith("norm"):
            buf.normal_(1.0, 0.3, generator=gen)
        elif leaf == "router_bias":
            buf.normal_(0.0, 0.05, generator=gen)
        elif leaf in ("gate_bias", "embed_tokens"):
            buf.normal_(0.0, 1.0, generator=gen)
        else:
            buf.normal_(0.0, buf.shape[-1] ** -0.5, generator=gen)


def default_device(target: Target) -> torch.device:
    return torch.device("cpu" if target.hardware.is_cpu else "cuda")


@dataclass
class RankModel:
    """The built rank: its model, how many layers, and notes on how it was made."""

    model: BeamForCausalLM
    layers: int
    notes: list[str]
    build_s: float


def build_rank_model(target: Target, layers: int | None = None,
                     device: str | torch.device | None = None, seed: int = 0,
                     model_path: str | None = None) -> RankModel:
    """Rank 0 of the target at its shard shapes with reference ops (callers pick kernel sets)."""
    dev = torch.device(device) if device is not None else default_device(target)
    n = layers or target.default_layers
    start = time.perf_counter()
    if model_path is not None:
        from model.weights import load_model

        model = load_model(model_path, dtype=torch.bfloat16, device=str(dev), tp=target.tp,
                           rank=0, ep=target.ep, kernels="reference")
        n = model.config.num_hidden_layers
        notes = [f"weights: rank 0 of {model_path} (TP{target.tp})"]
    else:
        if dev.type == "meta":
            raise TargetError("a random-weight rank needs a real device (cpu or cuda)")
        gen = torch.Generator(device=dev)
        gen.manual_seed(seed)
        with torch.device(dev):
            model = BeamForCausalLM(target.config(n), target.shard)
        fill_random(model, gen)
        notes = [f"weights: random (seed {seed}), filled on {dev}"]
    note = attach_rank(model)
    if note:
        notes.append(note)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    took = time.perf_counter() - start
    size = sum(b.numel() * b.element_size() for b in model.buffers())
    notes.append(f"{n} layers, {size / 1e9:.1f} GB of weights, built in {took:.1f} s")
    return RankModel(model, n, notes, took)


def free_model(rank: RankModel | None) -> None:
    """Drop the model and hand its memory back (before building another)."""
    if rank is None:
        return
    import gc

    rank.model = None  # type: ignore[assignment]
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
