"""Beam configuration: the released `config.json` schema, presets, and a per-rank TP shard view.

The field names, defaults and derived lists mirror transformers 5.23 `BeamConfig`, so a config we
write loads there and a released config loads here unchanged.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LAYER_TYPES = ("sliding_attention", "full_attention")
MLP_LAYER_TYPES = ("dense", "sparse")
DEFAULT_ROPE_THETA = 10000.0


def default_layer_types(num_layers: int) -> list[str]:
    # Every sixth layer runs full attention, and so does the last one (transformers' default).
    types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(num_layers)]
    if types:
        types[-1] = "full_attention"
    return types


def default_mlp_layer_types(num_layers: int) -> list[str]:
    dense = min(3, num_layers)
    return ["dense"] * dense + ["sparse"] * (num_layers - dense)


@dataclass(frozen=True)
class BeamConfig:
    vocab_size: int = 151936
    hidden_size: int = 5120
    intermediate_size: int = 20480
    num_hidden_layers: int = 52
    num_attention_heads: int = 48
    num_key_value_heads: int = 8
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 8192
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None
    attention_bias: bool = False
    sliding_window: int | None = 512
    attention_dropout: float = 0.0
    moe_intermediate_size: int = 2560
    num_experts_per_tok: int = 8
    num_experts: int = 256
    norm_topk_prob: bool = True
    output_router_logits: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    layer_types: list[str] | None = None
    mlp_layer_types: list[str] | None = None
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    final_logit_softcapping: float | None = 30.0
    # Keys of a config.json that are not Beam architecture fields (architectures, dtype, ...),
    # kept so that a read-then-write round trip loses nothing.
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if self.layer_types is None:
            object.__setattr__(self, "layer_types", default_layer_types(n))
        if self.mlp_layer_types is None:
            object.__setattr__(self, "mlp_layer_types", default_mlp_layer_types(n))
        if self.rope_parameters is None:
            rope = {
                "sliding_attention": {"rope_type": "default", "rope_theta": DEFAULT_ROPE_THETA},
                "full_attention": None,
            }
            object.__setattr__(self, "rope_parameters", rope)
        self._validate()

    def _validate(self) -> None:
        n = self.num_hidden_layers
        for name, allowed in (("layer_types", LAYER_TYPES), ("mlp_layer_types", MLP_LAYER_TYPES)):
            values = getattr(self, name)
            if len(values) != n:
                raise ValueError(
                    f"{name} has {len(values)} entries, expected num_hidden_layers={n}"
                )
            unknown = sorted(set(values) - set(allowed))
            if unknown:
                raise ValueError(
                    f"{name} contains unknown type(s) {unknown}; expected one of {allowed}"
                )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.num_experts % self.n_group:
            raise ValueError(
                f"num_experts ({self.num_experts}) must divide into n_group ({self.n_group})"
            )
        if self.num_experts // self.n_group < 2:
            raise ValueError("each expert group needs at least 2 experts (group score = top-2 sum)")
        if self.topk_group > self.n_group or self.num_experts_per_tok > self.num_experts:
            raise ValueError("topk_group must be <= n_group and num_experts_per_tok <= num_experts")
        for layer_type in set(self.layer_types):
            if layer_type not in self.rope_parameters:
                raise ValueError(f"rope_parameters has no entry for layer type {layer_type!r}")
            rope = self.rope_parameters[layer_type]
            if rope is not None and rope.get("rope_type", "default") != "default":
                raise ValueError(
                    f"unsupported rope_type {rope.get('rope_type')!r} (only 'default')"
                )
        if self.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r} (Beam uses 'silu')")
        if self.attention_bias:
            raise ValueError("attention_bias=True is not part of Beam and is not supported")

    # ---- derived values -------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def rope_theta(self, layer_type: str) -> float | None:
        rope = self.rope_parameters[layer_type]
        return None if rope is None else float(rope.get("rope_theta", DEFAULT_ROPE_THETA))

    def window(self, layer: int) -> int | None:
        """Sliding window (keys per query, including itself) of a layer; None for full attention."""
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def attn_add_index(self, layer: int) -> int:
        return 2 * (layer + 1)

    @property
    def num_sliding_layers(self) -> int:
        return sum(t == "sliding_attention" for t in self.layer_types)

    # ---- config.json ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        out = {**self.extra, **out}
        out.setdefault("architectures", ["BeamForCausalLM"])
        out["model_type"] = "beam"
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BeamConfig:
        if data.get("model_type", "beam") != "beam":
            raise ValueError(
                f"config.json has model_type {data.get('model_type')!r}, expected 'beam'"
            )
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in data.items() if k in names}
        extra = {k: v for k, v in data.items() if k not in names and k != "model_type"}
        return cls(**known, extra=extra)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> BeamConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        return cls.from_dict(json.loads(path.read_text()))

    def replace(self, **changes: Any) -> BeamConfig:
        if "num_hidden_layers" in changes:
            n = changes["num_hidden_layers"]
            changes.setdefault("layer_types", default_layer_types(n))
            changes.setdefault("mlp_layer_types", default_mlp_layer_types(n))
        return dataclasses.replace(self, **changes)

    def shard(self, tp: int, ep: int = 1) -> ShardSpec:
        return ShardSpec.of(self, tp, ep)


@dataclass(frozen=True)
class ShardSpec:
    """What one tensor-parallel rank holds, as in the vLLM / SGLang TP layouts.

    Query heads, the attention gate, the dense MLP, the expert intermediate dimension (TP) and the
    vocabulary split evenly; KV heads split while tp <= num_key_value_heads and are replicated
    (each rank keeps one) when tp exceeds them. With expert parallelism (ep > 1) the experts split
    across ranks instead of their intermediate dimension.
    """

    tp: int
    ep: int
    num_attention_heads: int
    num_key_value_heads: int
    kv_replicas: int
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    vocab_size: int
    head_dim: int
    hidden_size: int

    @classmethod
    def of(cls, cfg: BeamConfig, tp: int, ep: int = 1) -> ShardSpec:
        if tp < 1 or cfg.num_attention_heads % tp:
            raise ValueError(f"tp={tp} must divide num_attention_heads={cfg.num_attention_heads}")
        if ep not in (1, tp):
            raise ValueError(f"ep={ep} must be 1 (experts split by TP) or equal to tp={tp}")
        kvh = cfg.num_key_value_heads
        if tp <= kvh:
            if kvh % tp:
                raise ValueError(f"tp={tp} must divide num_key_value_heads={kvh}")
            kv_heads, replicas = kvh // tp, 1
        else:
            if tp % kvh:
                raise ValueError(f"tp={tp} must be a multiple of num_key_value_heads={kvh}")
            kv_heads, replicas = 1, tp // kvh
        for name in ("intermediate_size", "vocab_size"):
            if getattr(cfg, name) % tp:
                raise ValueError(f"tp={tp} must divide {name}={getattr(cfg, name)}")
        if ep > 1:
            if cfg.num_experts % ep:
                raise ValueError(f"ep={ep} must divide num_experts={cfg.num_experts}")
            moe_i, experts = cfg.moe_intermediate_size, cfg.num_experts // ep
        else:
            if cfg.moe_intermediate_size % tp:
                raise ValueError(f"tp={tp} must divide moe_intermediate_size")
            moe_i, experts = cfg.moe_intermediate_size // tp, cfg.num_experts
        return cls(
            tp=tp,
            ep=ep,
            num_attention_heads=cfg.num_attention_heads // tp,
            num_key_value_heads=kv_heads,
            kv_replicas=replicas,
            intermediate_size=cfg.intermediate_size // tp,
            moe_intermediate_size=moe_i,
            num_experts=experts,
            vocab_size=cfg.vocab_size // tp,
            head_dim=cfg.head_dim,
            hidden_size=cfg.hidden_size,
        )

    def kv_head_range(self, rank: int, total_kv_heads: int) -> tuple[int, int]:
        """Global KV heads [start, stop) held by `rank`."""
        if self.kv_replicas == 1:
            start = rank * self.num_key_value_heads
            return start, start + self.num_key_value_heads
        head = rank // self.kv_replicas
        return head, head + 1


PRESETS: dict[str, BeamConfig] = {
    "beam-1.0-501b": BeamConfig(),
    # Small enough for CPU tests and the demo server, with Beam's structure intact: 8 layers (full
    # attention at 5 and 7, dense MLP at 0-2), GQA, 8 expert groups of 4 with top-4 groups / top-8.
    "tiny": BeamConfig(
        vocab_size=2048,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        sliding_window=16,
        moe_intermediate_size=32,
        num_experts=32,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        pad_token_id=7,
        bos_token_id=7,
        eos_token_id=[5, 6],
    ),
}


def preset(name: str) -> BeamConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None
