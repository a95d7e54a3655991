"""The floor of one served step: the bytes it must move and the FLOPs it must do, over ceilings.

Bytes: every weight the step reads (all of the rank's weights except the experts, the embedding
rows of its tokens, and for each MoE layer only the experts its routing actually hit: counted
from the real routing of the recorded step, `OpCall.touched`) plus the KV cache it reads and
writes (decode: every sequence's keys in every layer, a window of them in sliding layers, and
the new token's K/V; prefill: the prompts' K/V written and read once). FLOPs: the op contracts'
and the GEMM regions' FLOPs. floor = max(bytes / bandwidth, FLOPs / BF16 rate), the router's
FP32 GEMM at the higher of the FP32 FMA rate and a third of the BF16 rate (exact three-term BF16
products: model/ops/_contract.py `fp32_gemm_flops_s`). Activations are not counted (small next
to weights at decode).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from ..targets import OpCall
from .attribution import FP32_OPS, Rates

EXPERT_BUFFERS = ("experts_gate_up", "experts_down")


@dataclass(frozen=True)
class StepFloor:
    weight_bytes: int  # weights read, touched experts included
    expert_bytes: int  # of which: the touched experts
    kv_bytes: int
    flops: int
    fp32_flops: int
    bandwidth_bytes_s: float
    floor_us: float
    bound: str  # "bytes" | "flops"
    experts_touched: tuple[int, ...]  # per MoE layer, from the step's routing
    experts_held: int  # experts per layer on this rank
    routing: str  # "recorded" | "upper bound (routing not recorded)"

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    def to_dict(self) -> dict:
        return asdict(self) | {"bytes": self.bytes}


def _buffer_bytes(model) -> tuple[int, int, int, int]:
    """(non-expert weights without the embedding, embedding row bytes, one expert's bytes in
    one layer, experts per layer on this rank)."""
    other, per_expert, held = 0, 0, 0
    for name, buf in model.named_buffers():
        leaf = name.rsplit(".", 1)[-1]
        size = buf.numel() * buf.element_size()
        if leaf in EXPERT_BUFFERS:
            held = buf.shape[0]
            continue
        if leaf == "embed_tokens":
            continue
        other += size
    moe = next((layer for layer in model.layers if not layer.dense), None)
    if moe is not None:
        per_expert = sum(getattr(moe, b)[0].numel() * getattr(moe, b).element_size()
                         for b in EXPERT_BUFFERS)
    row = model.config.hidden_size * model.embed_tokens.element_size()
    return other, row, per_expert, held


def kv_step_bytes(model, phase: str, batch: int, context: int) -> int:
    """KV bytes one step moves: decode reads every visible key and writes one token per
    sequence per layer; prefill writes each prompt token's K/V and reads it back once."""
    cfg, shard = model.config, model.shard
    per_token = 2 * shard.num_key_value_heads * cfg.head_dim * model.embed_tokens.element_size()
    total = 0
    for i in range(cfg.num_hidden_layers):
        if phase == "decode":
            keys = min(context, cfg.window(i) or context)
            total += batch * (keys + 1) * per_token
        else:
            total += 2 * batch * context * per_token
    return total


def step_floor(calls: Sequence[OpCall], model, phase: str, batch: int, context: int,
               rates: Rates) -> StepFloor:
    """The floor of the step whose calls were recorded (see the module docstring)."""
    other, row, per_expert, held = _buffer_bytes(model)
    tokens = next((c.shape["T"] for c in calls if c.name == "embed"), batch)
    touched: list[int] = []
    recorded = True
    for c in calls:
        if c.name != "moe_experts":
            continue
        if len(c.touched) == c.count:
            touched += list(c.touched)
        else:  # the meta-device inventory has no routing: every slot a distinct expert
            recorded = False
            touched += [min(held, c.shape["T"] * c.shape.get("k", 8))] * c.count
    experts = per_expert * sum(touched)
    weights = other + tokens * row + experts
    kv = kv_step_bytes(model, phase, batch, context)
    flops = sum(c.cost.flops * c.count for c in calls if c.name not in FP32_OPS)
    fp32 = sum(c.cost.flops * c.count for c in calls if c.name in FP32_OPS)
    bytes_s = (weights + kv) / rates.bandwidth_bytes_s
    flops_s = flops / rates.bf16_flops_s + fp32 / rates.fp32_gemm_flops_s
    return StepFloor(
        weight_bytes=weights, expert_bytes=experts, kv_bytes=kv, flops=flops, fp32_flops=fp32,
        bandwidth_bytes_s=rates.bandwidth_bytes_s, floor_us=1e6 * max(bytes_s, flops_s),
        bound="bytes" if bytes_s >= flops_s else "flops", experts_touched=tuple(touched),
        experts_held=held,
        routing="recorded" if recorded else "upper bound (routing not recorded)")


def moe_call_floor_bytes(call: OpCall) -> int:
    """Bytes of `count` moe_experts calls with the experts their routing hit (the contract's
    cost charges what its test inputs' routing hits on average)."""
    if len(call.touched) != call.count:
        return call.cost.bytes * call.count
    from model.ops import CONTRACTS

    cost = CONTRACTS["moe_experts"].cost
    return sum(cost({**call.shape, "touched": t}).bytes for t in call.touched)


__all__ = ["StepFloor", "kv_step_bytes", "moe_call_floor_bytes", "step_floor"]
