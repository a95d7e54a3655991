"""What one step calls, recorded from the forward that runs it (not a hand-kept list).

`record(model, run)` swaps a recording `OpTable` over the model's own implementations, runs
`run()` (one served step), and returns every op call with its shape (read from the call's
arguments through the op's SIGNATURE, completed by the contract's `shapes_for`) plus the model
regions entered (`region(...)` in model/beam.py: embeddings, GEMMs outside the ops, the lm_head;
and the attention backend's range). Under TP the boundary is `allreduce_norm_residual_norm`
because that is what the forward calls. A `moe_experts` call also records how many distinct
experts its routing hit on this rank: the weights the step actually reads.

`step_inventory(target, batch, layers, context)` records the target's served step on the meta
device (no memory, no kernels; the MoE op's data-dependent loop is stood in for by an empty
output of its shape), through the same engine and runner the GPU runs; `Target.step_calls` and
`Target.op_shapes` read it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from model import beam
from model.ops import CONTRACTS, Cost, OpTable

from ..targets import OpCall, Target, linear_cost

# Scalar arguments that are axes of the op's shape (the rest, add_index or eps, are not).
SCALAR_AXES = {("attention", "window"): "W"}
_TENSOR = re.compile(r"(\w+)\[([^\]]*)\]")
_PARAM = re.compile(r"(\w+)(?:\[[^\]]*\])?(?::\s*\w+)?")


@functools.cache
def _params(op: str) -> tuple[tuple[str, tuple[str, ...] | None], ...]:
    """(name, dims or None for a scalar) of each parameter in the op's SIGNATURE, in order."""
    sig = CONTRACTS[op].signature
    inside = sig[sig.index("(") + 1:]
    depth, end = 0, len(inside)
    for i, ch in enumerate(inside):  # the parameter list ends at its closing parenthesis
        depth += ch in "[("
        depth -= ch in "])"
        if depth < 0:
            end = i
            break
    out = []
    for part in _split_top(inside[:end]):
        m = _TENSOR.match(part.strip())
        if m:
            out.append((m.group(1), tuple(d.strip() for d in m.group(2).split(","))))
        else:
            out.append((_PARAM.match(part.strip()).group(1), None))
    return tuple(out)


def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += ch in "[("
        depth -= ch in "])"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return parts + ([cur] if cur.strip() else [])


def call_shape(op: str, args: tuple, kwargs: dict, cfg, shard) -> dict[str, int]:
    """The contract's shape of one call: `shapes_for` at the call's token count, with every
    axis the arguments show (a plain dim name of a tensor argument, or a scalar axis)."""
    seen: dict[str, int] = {}
    names = _params(op)
    bound = dict(zip((n for n, _ in names), args))
    bound.update(kwargs)
    for name, dims in names:
        value = bound.get(name)
        if dims is not None and isinstance(value, torch.Tensor) and value.dim() == len(dims):
            for d, size in zip(dims, value.shape):
                if re.fullmatch(r"[A-Za-z_]\w*", d):
                    seen.setdefault(d, int(size))
        elif (op, name) in SCALAR_AXES and isinstance(value, int):
            seen[SCALAR_AXES[(op, name)]] = int(value)
    if op == "attention" and "R" in seen and "page" in seen:
        seen.setdefault("S", seen["R"] * seen["page"])  # the keys a row's pages hold
    c = CONTRACTS[op]
    base = c.shapes_for(cfg, seen.get("T", 1), shard)
    return {k: seen.get(k, v) for k, v in base.items()} | \
        {k: v for k, v in seen.items() if k in c.axes and k not in base}


def touched_experts(args: tuple, kwargs: dict) -> int | None:
    """Distinct experts this rank holds that the call's routing hit (None on the meta device)."""
    names = [n for n, _ in _params("moe_experts")]
    bound = dict(zip(names, args)) | kwargs
    ids, gate_up = bound["ids"], bound["gate_up"]
    if ids.device.type == "meta":
        return None
    local = ids - int(bound.get("expert_offset", 0) or 0)
    local = local[(local >= 0) & (local < gate_up.shape[0])]
    return int(torch.unique(local).numel())


@dataclass
class Recording:
    """The calls of one recorded step, in order: (op or region, shape, touched experts)."""

    calls: list[tuple[str, dict[str, int], int | None]] = field(default_factory=list)
    regions: list[str] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for name, _, _ in self.calls:
            out[name] = out.get(name, 0) + 1
        for name in self.regions:
            out[name] = out.get(name, 0) + 1
        return out


def _recording_table(ops: OpTable, rec: Recording, cfg, shard, abstract: bool) -> OpTable:
    def wrap(name: str, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            touched = touched_experts(args, kwargs) if name == "moe_experts" else None
            rec.calls.append((name, call_shape(name, args, kwargs, cfg, shard), touched))
            if abstract and name in ("moe_experts", "attention"):
                # Their references read values (experts present; a prefill chunk's positions):
                # none on the meta device. The output has the shape of the first argument.
                return torch.empty_like(args[0])
            return fn(*args, **kwargs)

        return call

    table = OpTable({n: wrap(n, ops.impl(n)) for n in CONTRACTS}, ops.sources)
    for key, value in vars(ops).items():  # what the registry attached (`resolution`, ...)
        if key not in ("_impls", "sources"):
            setattr(table, key, value)
    return table


@contextlib.contextmanager
def recording(model, abstract: bool = False) -> Iterator[Recording]:
    """Inside, every op call and model region of `model` is recorded (the ops still run)."""
    rec = Recording()
    ops, real_region = model.ops, beam.region

    @contextlib.contextmanager
    def counted(name: str):
        rec.regions.append(name)
        with real_region(name):
            yield

    model.set_ops(_recording_table(ops, rec, model.config, model.shard, abstract))
    beam.region = counted
    try:
        yield rec
    finally:
        beam.region = real_region
        model.set_ops(ops)


# ---- the inventory as OpCalls ------------------------------------------------------------------
def region_cost(name: str, model, tokens: int, rows: int, context: int,
                phase: str) -> tuple[dict, Cost]:
    """Shape and cost of one entry into a model region (GEMMs outside the ops, embeddings; the
    attention backend's range holds only the attention op, whose cost is the op's)."""
    cfg, shard = model.config, model.shard
    h, hq_d = cfg.hidden_size, shard.num_attention_heads * cfg.head_dim
    costs: dict[str, Callable[[], tuple[dict, Cost]]] = {
        "embed": lambda: ({"T": tokens, "H": h}, Cost(bytes=2 * 2 * tokens * h)),
        "rope_tables": lambda: ({"T": tokens, "D": cfg.head_dim},
                                Cost(bytes=2 * 4 * tokens * cfg.head_dim)),
        "o_proj": lambda: ({"T": tokens, "K": hq_d, "N": h}, linear_cost(tokens, hq_d, h)),
        "dense_gate_up": lambda: ({"T": tokens, "K": h, "N": 2 * shard.intermediate_size},
                                  linear_cost(tokens, h, 2 * shard.intermediate_size)),
        "dense_down": lambda: ({"T": tokens, "K": shard.intermediate_size, "N": h},
                               linear_cost(tokens, shard.intermediate_size, h)),
        "lm_head": lambda: ({"T": rows, "K": h, "N": shard.vocab_size},
                            linear_cost(rows, h, shard.vocab_size)),
        "paged_attention": lambda: ({"T": tokens, "S": context}, Cost(bytes=0)),
    }
    if name not in costs:
        return {"T": tokens}, Cost(bytes=0)
    return costs[name]()


def to_calls(rec: Recording, model, context: int, phase: str) -> list[OpCall]:
    """Aggregate a recording into OpCalls (one per op and shape), regions last."""
    grouped: dict[tuple[str, str], list] = {}
    for name, shape, touched in rec.calls:
        key = (name, json.dumps(shape, sort_keys=True))
        grouped.setdefault(key, [shape, 0, []])
        grouped[key][1] += 1
        if touched is not None:
            grouped[key][2].append(touched)
    out = [OpCall(name, shape, n, CONTRACTS[name].cost(shape), tuple(t))
           for (name, _), (shape, n, t) in grouped.items()]
    tokens = next((s["T"] for n, s, _ in rec.calls if n == "rmsnorm"), 1)
    rows = next((s["T"] for n, s, _ in rec.calls if n == "logit_softcap"), tokens)
    for name in dict.fromkeys(rec.regions):
        shape, cost = region_cost(name, model, tokens, rows, context, phase)
        out.append(OpCall(name, shape, rec.regions.count(name), cost))
    return out


def _meta_model(target: Target, layers: int | None):
    from .rank import attach_rank

    with torch.device("meta"):
        model = beam.BeamForCausalLM(target.config(layers), target.shard)
    attach_rank(model)
    return model


@functools.lru_cache(maxsize=64)
def _inventory(target: Target, batch: int, layers: int | None, context: int) -> tuple[OpCall, ...]:
    from .served import ServedStep, ServeShape

    model = _meta_model(target, layers)
    shape = ServeShape(target.phase, batch, context, steps=2)
    gpu = not target.hardware.is_cpu
    served = ServedStep(model, shape, cuda_graphs=False, attention_backend="torch",
                        batched_decode=gpu)
    served.start(batch)
    with served.eager(), recording(model, abstract=True) as rec:
        served.forward_only()
    return tuple(to_calls(rec, model, context, target.phase))


def step_inventory(target: Target, batch: int, layers: int | None = None,
                   context: int | None = None) -> list[OpCall]:
    """Every op and region call of one served step of `target` (recorded on the meta device)."""
    return list(_inventory(target, batch, layers, context or target.contexts[0]))


def record_step(served, run: Callable[[], Any] | None = None) -> tuple[list[OpCall], Any]:
    """Record one served step on its own device (real routing); returns (calls, logits)."""
    with served.eager() as logits, recording(served.model) as rec:
        (run or served.step)()
    calls = to_calls(rec, served.model, served.shape.context, served.shape.phase)
    return calls, (logits[-1] if logits else None)


__all__ = ["Recording", "call_shape", "record_step", "recording", "step_inventory",
           "to_calls", "touched_experts"]
