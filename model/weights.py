"""Hugging Face checkpoints: the exact transformers tensor names, memory-mapped, sliced per TP rank.

A checkpoint is a directory with `config.json` and either `model.safetensors` or shards listed in
`model.safetensors.index.json`. Every tensor is checked before anything is loaded: a missing,
unexpected, wrongly shaped or wrongly typed tensor fails with a message naming it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from .beam import BeamForCausalLM
from .config import BeamConfig, ShardSpec
from .ops.qkv_gate_proj import pack_qkv_gate

FP32_TENSORS = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")
_FLOAT_DTYPES = {"BF16", "F16", "F32"}


class CheckpointError(ValueError):
    """A checkpoint that does not match its config: says which tensor and what was expected."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    fp32: bool = False


def expected_tensors(cfg: BeamConfig, fused_experts: bool = False) -> list[TensorSpec]:
    """Every tensor of a full (unsharded) checkpoint, with its transformers name and shape.

    Experts come in two layouts: per expert (`mlp.experts.{j}.gate_proj.weight`, `up_proj`,
    `down_proj`), which is what transformers' `save_pretrained` writes and released checkpoints
    use, or fused 3D tensors (`mlp.experts.gate_up_proj [E, 2I, H]`, `mlp.experts.down_proj
    [E, H, I]`), transformers' in-memory layout. Both load.
    """
    h, d, v = cfg.hidden_size, cfg.head_dim, cfg.vocab_size
    specs = [TensorSpec("model.embed_tokens.weight", (v, h)), TensorSpec("model.norm.weight", (h,))]
    if not cfg.tie_word_embeddings:
        specs.append(TensorSpec("lm_head.weight", (v, h)))
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        specs += [
            TensorSpec(p + n + ".weight", (h,))
            for n in (
                "input_layernorm",
                "post_attention_layernorm",
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm",
            )
        ]
        a = p + "self_attn."
        specs += [
            TensorSpec(a + "q_proj.weight", (cfg.q_size, h)),
            TensorSpec(a + "k_proj.weight", (cfg.kv_size, h)),
            TensorSpec(a + "v_proj.weight", (cfg.kv_size, h)),
            TensorSpec(a + "gate_proj.weight", (cfg.q_size, h)),
            TensorSpec(a + "o_proj.weight", (h, cfg.q_size)),
            TensorSpec(a + "q_norm.weight", (d,)),
            TensorSpec(a + "k_norm.weight", (d,)),
            TensorSpec(a + "gate_bias", (cfg.num_attention_heads,)),
        ]
        m = p + "mlp."
        if cfg.mlp_layer_types[i] == "dense":
            inter = cfg.intermediate_size
            specs += [
                TensorSpec(m + "gate_proj.weight", (inter, h)),
                TensorSpec(m + "up_proj.weight", (inter, h)),
                TensorSpec(m + "down_proj.weight", (h, inter)),
            ]
        else:
            e, inter = cfg.num_experts, cfg.moe_intermediate_size
            specs += [
                TensorSpec(m + "gate.weight", (e, h), fp32=True),
                TensorSpec(m + "gate.e_score_correction_bias", (e,), fp32=True),
            ]
            if fused_experts:
                specs += [
                    TensorSpec(m + "experts.gate_up_proj", (e, 2 * inter, h)),
                    TensorSpec(m + "experts.down_proj", (e, h, inter)),
                ]
            else:
                for j in range(e):
                    x = f"{m}experts.{j}."
                    specs += [
                        TensorSpec(x + "gate_proj.weight", (inter, h)),
                        TensorSpec(x + "up_proj.weight", (inter, h)),
                        TensorSpec(x + "down_proj.weight", (h, inter)),
                    ]
    return specs


class CheckpointReader:
    """Memory-mapped access to the tensors of a (possibly sharded) safetensors checkpoint."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif single.exists():
            weight_map = None
        else:
            raise CheckpointError(
                f"{self.path} has neither model.safetensors nor model.safetensors.index.json"
            )
        self._handles: dict[str, object] = {}
        self.location: dict[str, str] = {}
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        for fname in files:
            handle = self._open(fname)
            for key in handle.keys():
                self.location[key] = fname
        if weight_map:
            for key, fname in weight_map.items():
                if self.location.get(key) != fname:
                    raise CheckpointError(f"index lists {key} in {fname}, which does not hold it")

    def _open(self, fname: str):
        if fname not in self._handles:
            file = self.path / fname
            if not file.exists():
                raise CheckpointError(f"checkpoint shard {file} is missing")
            try:
                self._handles[fname] = safe_open(str(file), framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own error types for bad headers
                raise CheckpointError(
                    f"cannot read {file}: {exc} (truncated or not a safetensors file?)"
                ) from exc
        return self._handles[fname]

    def meta(self, name: str) -> tuple[tuple[int, ...], str]:
        sl = self._open(self.location[name]).get_slice(name)
        return tuple(sl.get_shape()), sl.get_dtype()

    def read(self, name: str, index: tuple | None = None) -> torch.Tensor:
        """The tensor, or only `sl[index]` of it (a rank's slice is all that is read)."""
        sl = self._open(self.location[name]).get_slice(name)
        try:
            return sl[index] if index is not None else sl[:]
        except Exception as exc:
            raise CheckpointError(
                f"cannot read tensor {name} from {self.location[name]}: {exc} (truncated file?)"
            ) from exc


def has_fused_experts(reader: CheckpointReader) -> bool:
    return any(k.endswith("mlp.experts.gate_up_proj") for k in reader.location)


def check_checkpoint(reader: CheckpointReader, cfg: BeamConfig) -> None:
    expected = {s.name: s for s in expected_tensors(cfg, has_fused_experts(reader))}
    missing = sorted(set(expected) - set(reader.location))
    # Rotary inv_freq buffers are non-persistent in transformers; anything else is unexpected.
    unexpected = sorted(set(reader.location) - set(expected))
    if missing:
        s = expected[missing[0]]
        raise CheckpointError(
            f"checkpoint {reader.path} is missing {len(missing)} tensor(s), "
            f"first {s.name} (expected shape {list(s.shape)})"
        )
    if unexpected:
        raise CheckpointError(
            f"checkpoint {reader.path} has {len(unexpected)} unexpected "
            f"tensor(s), first {unexpected[0]}: does config.json match it?"
        )
    for name, spec in expected.items():
        shape, dtype = reader.meta(name)
        if shape != spec.shape:
            raise CheckpointError(
                f"tensor {name}: expected shape {list(spec.shape)}, found "
                f"{list(shape)} in {reader.location[name]}"
            )
        if dtype not in _FLOAT_DTYPES or (spec.fp32 and dtype != "F32"):
            want = "F32" if spec.fp32 else "one of BF16/F16/F32"
            raise CheckpointError(f"tensor {name}: expected dtype {want}, found {dtype}")


def _rows(start: int, stop: int) -> tuple:
    return (slice(start, stop),)


def _cols(start: int, stop: int) -> tuple:
    return (slice(None), slice(start, stop))


def rank_slices(cfg: BeamConfig, shard: ShardSpec, rank: int) -> dict[str, Callable]:
    """Slice index per tensor-name suffix for one TP rank (row- or column-parallel)."""
    d = cfg.head_dim
    hq = shard.num_attention_heads
    q0, q1 = rank * hq * d, (rank + 1) * hq * d
    k0, k1 = shard.kv_head_range(rank, cfg.num_key_value_heads)
    i = shard.intermediate_size
    v = shard.vocab_size
    return {
        "q_proj.weight": _rows(q0, q1),
        "self_attn.gate_proj.weight": _rows(q0, q1),
        "k_proj.weight": _rows(k0 * d, k1 * d),
        "v_proj.weight": _rows(k0 * d, k1 * d),
        "o_proj.weight": _cols(q0, q1),
        "gate_bias": _rows(rank * hq, (rank + 1) * hq),
        "mlp.gate_proj.weight": _rows(rank * i, (rank + 1) * i),
        "mlp.up_proj.weight": _rows(rank * i, (rank + 1) * i),
        "mlp.down_proj.weight": _cols(rank * i, (rank + 1) * i),
        "embed_tokens.weight": _rows(rank * v, (rank + 1) * v),
        "lm_head.weight": _rows(rank * v, (rank + 1) * v),
    }


def _read_sharded(reader, name: str, slices: dict, tp: int):
    if tp == 1:
        return reader.read(name)
    for suffix, index in slices.items():
        if name.endswith(suffix):
            return reader.read(name, index)
    return reader.read(name)


def _expert_range(shard: ShardSpec, rank: int) -> range:
    start = rank * shard.num_experts if shard.ep > 1 else 0
    return range(start, start + shard.num_experts)


def _read_experts(reader, prefix: str, cfg: BeamConfig, shard: ShardSpec, rank: int):
    """(gate_up [E, 2I, H], down [E, H, I]) of this rank: its experts (EP) or an I slice (TP)."""
    full = cfg.moe_intermediate_size
    i0, i1 = 0, full
    if shard.ep == 1 and shard.tp > 1:
        i0, i1 = rank * shard.moe_intermediate_size, (rank + 1) * shard.moe_intermediate_size
    experts = _expert_range(shard, rank)
    e_sl = slice(experts.start, experts.stop)
    if prefix + "experts.gate_up_proj" in reader.location:
        name = prefix + "experts.gate_up_proj"
        gate = reader.read(name, (e_sl, slice(i0, i1)))
        up = reader.read(name, (e_sl, slice(full + i0, full + i1)))
        down = reader.read(prefix + "experts.down_proj", (e_sl, slice(None), slice(i0, i1)))
        return torch.cat([gate, up], dim=1), down
    gate_up, down = [], []
    for j in experts:
        x = f"{prefix}experts.{j}."
        gate_up.append(
            torch.cat(
                [
                    reader.read(x + "gate_proj.weight", (slice(i0, i1),)),
                    reader.read(x + "up_proj.weight", (slice(i0, i1),)),
                ]
            )
        )
        down.append(reader.read(x + "down_proj.weight", (slice(None), slice(i0, i1))))
    return torch.stack(gate_up), torch.stack(down)


def iter_rank_tensors(reader, cfg, shard, rank) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, this rank's tensor) for every tensor; experts as fused `experts.gate_up_proj` /
    `experts.down_proj` whatever the checkpoint's layout."""
    slices = rank_slices(cfg, shard, rank)
    for spec in expected_tensors(cfg, fused_experts=True):
        if spec.name.endswith("experts.gate_up_proj"):
            prefix = spec.name.removesuffix("experts.gate_up_proj")
            gate_up, down = _read_experts(reader, prefix, cfg, shard, rank)
            yield spec.name, gate_up
            yield prefix + "experts.down_proj", down
        elif not spec.name.endswith("experts.down_proj"):
            yield spec.name, _read_sharded(reader, spec.name, slices, shard.tp)


_LAYER_NAMES = {
    "input_layernorm.weight": "input_norm",
    "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "pre_ff_norm",
    "post_feedforward_layernorm.weight": "post_ff_norm",
    "self_attn.o_proj.weight": "o_proj",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
    "self_attn.gate_bias": "gate_bias",
    "mlp.gate_proj.weight": "gate_proj",
    "mlp.up_proj.weight": "up_proj",
    "mlp.down_proj.weight": "down_proj",
    "mlp.gate.weight": "router_weight",
    "mlp.gate.e_score_correction_bias": "router_bias",
    "mlp.experts.gate_up_proj": "experts_gate_up",
    "mlp.experts.down_proj": "experts_down",
}
_QKVG = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.gate_proj.weight",
)


def _assign(target: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if tuple(target.shape) != tuple(value.shape):
        raise CheckpointError(
            f"tensor {name}: rank slice has shape {list(value.shape)}, model "
            f"expects {list(target.shape)}"
        )
    target.copy_(value.to(target.dtype))


def load_into(model: BeamForCausalLM, reader: CheckpointReader) -> None:
    cfg, shard = model.config, model.shard
    pending: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in iter_rank_tensors(reader, cfg, shard, model.rank):
        if name == "model.embed_tokens.weight":
            _assign(model.embed_tokens, value, name)
            if cfg.tie_word_embeddings:
                _assign(model.lm_head, value, name)
        elif name == "model.norm.weight":
            _assign(model.final_norm, value, name)
        elif name == "lm_head.weight":
            _assign(model.lm_head, value, name)
        else:
            idx, suffix = name.removeprefix("model.layers.").split(".", 1)
            layer = model.layers[int(idx)]
            if suffix in _QKVG:
                parts = pending.setdefault(int(idx), {})
                parts[suffix] = value
                if len(parts) == 4:
                    packed = pack_qkv_gate(*(parts.pop(s) for s in _QKVG))
                    _assign(layer.qkv_gate_weight, packed, f"model.layers.{idx}.self_attn.qkv")
            else:
                _assign(getattr(layer, _LAYER_NAMES[suffix]), value, name)


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    tp: int = 1,
    rank: int = 0,
    ep: int = 1,
    kernels: str | Path = "tuned",
    registry: str | Path | None = None,
) -> BeamForCausalLM:
    """Load a Beam checkpoint (HF layout) for one TP rank; the router stays FP32. A directory
    made by `model.tp_ranks.write_random_model_dir` gives random weights at the rank's shapes.

    `kernels` picks every op's implementation through the registry (model/registry/): `tuned`
    (the lock's section for `device`'s arch), `reference`, or the path of a lock file; variants
    and their evidence come from `registry` (default: the checkout's kernels/ or the shipped one).
    """
    from .registry import resolve_ops
    from .tp_ranks import random_rank_model, random_weights_seed

    cfg = BeamConfig.load(path)
    seed = random_weights_seed(path)
    if seed is not None:  # a random-weights directory: the rank's slice is filled on its device
        ops = resolve_ops(kernels, registry, device=device, dtype=dtype)
        return random_rank_model(cfg, tp, rank, device, dtype, seed, ep, ops)
    reader = CheckpointReader(path)
    check_checkpoint(reader, cfg)
    ops = resolve_ops(kernels, registry, device=device, dtype=dtype)
    model = BeamForCausalLM(cfg, cfg.shard(tp, ep), rank=rank, dtype=dtype, ops=ops)
    load_into(model, reader)
    return model.to(device)
