"""Beam-1.0 decoder, written against the op contracts in `model/ops`.

Per layer (L 0-based, 52 layers, hidden H=5120, Hq=48 query / Hkv=8 KV heads of D=128):
    x            pre-normed input [T, H] (the previous boundary's `next` norm)
    q,k,v,g      = qkv_gate_proj(x)                 # one packed GEMM
    q            = qk_norm_rope | qk_norm_ssmax     # sliding-window (RoPE) / full (NoPE + SSMax),
                                                    # both also write K and V into the KV cache
    o            = gated_o_proj(attention(q, the cache), g, bias, o_proj)  # gate, then o_proj
    x, h         = norm_residual_norm(o, h, post_attn, pre_ff, 2(L+1))
    m            = dense SwiGLU MLP (L < 3) | router + moe_experts (256 experts, top-8)
    x, h         = norm_residual_norm(m, h, post_ff, next input norm or final norm, 2(L+1)+1)
logits = logit_softcap(lm_head(x), 30) in FP32.
Under TP the o_proj, dense down and combined-expert outputs are per-rank partials; each boundary
sums them (allreduce_norm_residual_norm, through model/parallel.py) before its norms.

Tokens are flat ([T] ids, [T] positions); an `AttentionBackend` knows how they split into
sequences and where their keys live: `CausalAttention` (no cache, a per-forward scratch) here,
a paged KV cache in the serving runtime (model/serve/paged_attention.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import BeamConfig, ShardSpec
from .ops import OpTable, region
from .ops.qk_norm_rope import inv_freq as rope_inv_freq
from .ops.qk_norm_rope import rope_tables


@dataclass
class Batch:
    """A flat batch of tokens from one or more sequences (the no-cache forward)."""

    positions: torch.Tensor  # [T] int64
    seq_bounds: Sequence[tuple[int, int]]  # [start, stop) of each sequence in the flat tokens


class AttentionBackend(Protocol):
    """Where a layer's keys live and attention over them; the runtime plugs a paged KV cache in.

    Per layer the model first asks `kv_cache` where this step's K and V go (the layer's cache
    pages [P, page, Hkv, D] and one slot per token): the Q/K norm op writes them there. Then
    `__call__` attends the (normed, rotated or SSMax-scaled) queries to the cached keys through
    the `attention` op and returns [T, Hq, D].
    """

    def kv_cache(
        self, layer: int, v: torch.Tensor, batch
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def __call__(
        self, layer: int, q: torch.Tensor, window: int, scale: float, batch
    ) -> torch.Tensor: ...


class CausalAttention:
    """No cache: each forward's K/V go to a scratch of one-token pages (slot t = token t) and
    every sequence attends to its own tokens through the `attention` op."""

    def __init__(self, ops: OpTable) -> None:
        self.ops = ops
        self._kv: tuple[torch.Tensor, torch.Tensor] | None = None
        self._meta: tuple[object, tuple[torch.Tensor, ...]] | None = None

    def kv_cache(self, layer: int, v: torch.Tensor, batch: Batch):
        t = v.shape[0]
        shape = (t, 1, *v.shape[1:])
        self._kv = (torch.empty(shape, dtype=v.dtype, device=v.device),
                    torch.empty(shape, dtype=v.dtype, device=v.device))
        return (*self._kv, torch.arange(t, device=v.device))

    def tables(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        """(page_table, kv_base, q_seq) of a batch: row b holds sequence b's token slots."""
        if self._meta is None or self._meta[0] is not batch:
            dev = batch.positions.device
            width = max(stop - start for start, stop in batch.seq_bounds)
            rows = [list(range(start, stop)) + [start] * (width - stop + start)
                    for start, stop in batch.seq_bounds]
            starts = torch.tensor([start for start, _ in batch.seq_bounds], device=dev)
            q_seq = [b for b, (start, stop) in enumerate(batch.seq_bounds)
                     for _ in range(stop - start)]
            self._meta = (batch, (torch.tensor(rows, dtype=torch.long, device=dev),
                                  batch.positions[starts],
                                  torch.tensor(q_seq, dtype=torch.long, device=dev)))
        return self._meta[1]

    def __call__(self, layer, q, window, scale, batch: Batch) -> torch.Tensor:
        if self._kv is None or self._kv[0].shape[0] != q.shape[0]:
            raise RuntimeError("CausalAttention: kv_cache(layer, v, batch) must be called for "
                               "this layer's tokens before attention")
        k_cache, v_cache = self._kv
        table, base, q_seq = self.tables(batch)
        return self.ops.attention(q, k_cache, v_cache, table, base, q_seq, batch.positions,
                                  window, scale)


def _buffer(module: nn.Module, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    module.register_buffer(name, torch.empty(shape, dtype=dtype), persistent=False)


class BeamLayer(nn.Module):
    """One decoder layer's tensors at a rank's shard shapes (names follow our packed layout)."""

    def __init__(self, cfg: BeamConfig, shard: ShardSpec, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        hq, hkv = shard.num_attention_heads, shard.num_key_value_heads
        self.sliding = cfg.layer_types[layer] == "sliding_attention"
        self.dense = cfg.mlp_layer_types[layer] == "dense"
        for name in ("input_norm", "post_attn_norm", "pre_ff_norm", "post_ff_norm"):
            _buffer(self, name, (h,), dtype)
        _buffer(self, "qkv_gate_weight", ((2 * hq + 2 * hkv) * d, h), dtype)
        _buffer(self, "gate_bias", (hq,), dtype)
        _buffer(self, "q_norm", (d,), dtype)
        _buffer(self, "k_norm", (d,), dtype)
        _buffer(self, "o_proj", (h, hq * d), dtype)
        if self.dense:
            i = shard.intermediate_size
            _buffer(self, "gate_proj", (i, h), dtype)
            _buffer(self, "up_proj", (i, h), dtype)
            _buffer(self, "down_proj", (h, i), dtype)
        else:
            e, i = shard.num_experts, shard.moe_intermediate_size
            # The router stays FP32 whatever the model dtype (docs/numerics.md).
            _buffer(self, "router_weight", (cfg.num_experts, h), torch.float32)
            _buffer(self, "router_bias", (cfg.num_experts,), torch.float32)
            _buffer(self, "experts_gate_up", (e, 2 * i, h), dtype)
            _buffer(self, "experts_down", (e, h, i), dtype)


class BeamForCausalLM(nn.Module):
    """Beam at one rank's shard shapes. `model(input_ids[B,S])` -> FP32 logits [B, S, V]."""

    def __init__(
        self,
        cfg: BeamConfig,
        shard: ShardSpec | None = None,
        rank: int = 0,
        dtype: torch.dtype = torch.bfloat16,
        ops: OpTable | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.shard = shard or cfg.shard(1)
        self.rank = rank
        self.ops = ops or OpTable()
        self.attention_backend: AttentionBackend = CausalAttention(self.ops)
        # Row-parallel partial sums and the vocab gather; identity at TP=1 (model/parallel.py).
        self.all_reduce: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
        self.gather_vocab: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
        # The boundary over rank partials at TP > 1 (TPGroup.boundary); None: norm_residual_norm.
        self.tp_boundary: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
        v, h = self.shard.vocab_size, cfg.hidden_size
        _buffer(self, "embed_tokens", (v, h), dtype)
        _buffer(self, "final_norm", (h,), dtype)
        _buffer(self, "lm_head", (v, h), dtype)
        self.layers = nn.ModuleList(
            BeamLayer(cfg, self.shard, i, dtype) for i in range(cfg.num_hidden_layers)
        )
        theta = next((cfg.rope_theta(t) for t in cfg.layer_types if cfg.rope_theta(t)), None)
        # inv_freq is computed on the CPU in FP32 at init, as transformers does.
        self.inv_freq = rope_inv_freq(cfg.head_dim, theta) if theta else None

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    def set_ops(self, ops: OpTable) -> None:
        self.ops = ops
        if isinstance(self.attention_backend, CausalAttention):
            self.attention_backend = CausalAttention(ops)

    # ---- the forward --------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full causal forward of `input_ids [B, S]` (no cache) -> FP32 logits [B, S, V]."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        b, s = input_ids.shape
        positions = torch.arange(s, device=input_ids.device).repeat(b)
        batch = Batch(positions=positions, seq_bounds=[(i * s, (i + 1) * s) for i in range(b)])
        hidden = self.forward_tokens(input_ids.reshape(-1), positions, batch)
        return self.compute_logits(hidden).reshape(b, s, -1)

    @torch.no_grad()
    def forward_tokens(self, ids: torch.Tensor, positions: torch.Tensor, batch) -> torch.Tensor:
        """Decoder over flat tokens -> final-normed hidden states [T, H]."""
        cfg, ops = self.config, self.ops
        h = self.embed(ids)  # [T, H] residual stream, BF16
        x = ops.rmsnorm(h, self.layers[0].input_norm, cfg.rms_norm_eps)
        with region("rope_tables"):
            cos, sin = (
                rope_tables(positions, self.inv_freq) if self.inv_freq is not None else (None, None)
            )
        n = len(self.layers)
        for i, layer in enumerate(self.layers):
            a = self.attention_block(i, layer, x, positions, cos, sin, batch)
            x, h = self.boundary(
                a, h, layer.post_attn_norm, layer.pre_ff_norm, cfg.attn_add_index(i)
            )
            m = self.mlp_block(layer, x)
            nxt = self.layers[i + 1].input_norm if i + 1 < n else self.final_norm
            x, h = self.boundary(m, h, layer.post_ff_norm, nxt, cfg.attn_add_index(i) + 1)
        return x

    def boundary(self, partial, h, post_weight, next_weight, add_index: int):
        """(normed next input, new residual) from a branch output (a rank partial under TP)."""
        eps = self.config.rms_norm_eps
        if self.tp_boundary is None:
            return self.ops.norm_residual_norm(partial, h, post_weight, next_weight, add_index, eps)
        return self.tp_boundary(self.ops, partial, h, post_weight, next_weight, add_index, eps)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        with region("embed"):
            if self.shard.tp == 1:
                return F.embedding(ids, self.embed_tokens)
            v = self.shard.vocab_size
            local = ids - self.rank * v
            hit = (local >= 0) & (local < v)
            out = F.embedding(local.clamp(0, v - 1), self.embed_tokens) * hit[:, None]
            return self.all_reduce(out)

    def attention_block(self, i, layer, x, positions, cos, sin, batch) -> torch.Tensor:
        cfg, ops, shard = self.config, self.ops, self.shard
        q, k, v, g = ops.qkv_gate_proj(
            x, layer.qkv_gate_weight, shard.num_attention_heads, shard.num_key_value_heads
        )  # q,g [T,Hq,D]; k,v [T,Hkv,D]
        backend, eps = self.attention_backend, cfg.rms_norm_eps
        k_cache, v_cache, slots = backend.kv_cache(i, v, batch)  # where this step's K/V go
        if layer.sliding:
            q = ops.qk_norm_rope(q, k, v, layer.q_norm, layer.k_norm, cos, sin, eps,
                                 k_cache, v_cache, slots)[0]
        else:
            q = ops.qk_norm_ssmax(q, k, v, layer.q_norm, layer.k_norm, positions, eps,
                                  k_cache, v_cache, slots)[0]
        o = backend(i, q, cfg.window(i) or 0, cfg.head_dim**-0.5, batch)  # reads the cache
        # The gate and o_proj: [T, H], a rank partial under TP (one kernel where a variant fuses
        # them; otherwise the table's attn_output_gate, then the library GEMM).
        return ops.gated_o_proj(o, g, layer.gate_bias, layer.o_proj)

    def mlp_block(self, layer: BeamLayer, x: torch.Tensor) -> torch.Tensor:
        cfg, ops = self.config, self.ops
        if layer.dense:
            with region("dense_gate_up"):
                gate, up = F.linear(x, layer.gate_proj), F.linear(x, layer.up_proj)
            act = ops.swiglu(gate, up)  # [T, I]
            with region("dense_down"):
                return F.linear(act, layer.down_proj)  # [T, H], a rank partial under TP
        weights, ids = ops.router(
            x,
            layer.router_weight,
            layer.router_bias,
            cfg.n_group,
            cfg.topk_group,
            cfg.num_experts_per_tok,
        )  # [T, k] each
        offset = self.rank * self.shard.num_experts if self.shard.ep > 1 else 0
        out = ops.moe_experts(
            x,
            layer.experts_gate_up,
            layer.experts_down,
            weights,
            ids,
            cfg.routed_scaling_factor,
            offset,
        )
        return out  # this rank's combined experts: a partial under TP (summed at the boundary)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with region("lm_head"):
            z = self.gather_vocab(F.linear(hidden, self.lm_head))  # [T, V] BF16
        cap = self.config.final_logit_softcapping
        return self.ops.logit_softcap(z, cap) if cap else z.float()
