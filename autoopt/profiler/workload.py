"""The step a target profiles: Beam at the target's per-rank shapes, random weights, full KV.

`build_workload` makes the model directly on the device with random weights (the 52-layer TP8
rank of Beam is ~125 GB in BF16: it fits one 141 GB H200 with the KV cache of up to ~32
sequences of 100k keys; where it does not fit, the largest layer count that does is used and
said). A decode step feeds one token per sequence against a KV cache pre-filled to the target's
context (`StaticKVAttention`); a prefill step runs whole prompts through the causal backend.
Logits are computed for the last token of each sequence, as a serving step does.

Run as a module (`python -m autoopt.profiler.workload ...`) it builds the same workload and runs
one step inside the NVTX range `autoopt_step`: that is the process Nsight Compute profiles.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import torch

from model.beam import Batch, BeamForCausalLM
from model.ops import OpTable, region

from ..targets import Target, TargetError, load_target

STEP_RANGE = "autoopt_step"
_GIB = 1 << 30


class StaticKVAttention:
    """Decode attention over a pre-filled paged cache: one query per sequence at position
    context-1.

    Full-attention layers hold `context` keys per sequence, sliding layers the last `window`
    (all they can see), each sequence in its own pages of 16. The Q/K norm op writes the new
    token's K/V into its slot (the last key), and one `attention` call per layer reads them, as
    the serving runtime's paged backend does.
    """

    PAGE = 16

    def __init__(self, model: BeamForCausalLM, batch: int, context: int,
                 gen: torch.Generator) -> None:
        cfg, shard = model.config, model.shard
        # The op table, not the model: a model <-> backend cycle would keep ~125 GB alive until
        # the garbage collector happens to run.
        self.ops, self.batch = model.ops, batch
        dev, dt, page = model.device, model.dtype, self.PAGE
        self.q_seq = torch.arange(batch, device=dev)
        self.q_pos = torch.full((batch,), context - 1, dtype=torch.long, device=dev)
        self.k, self.v, self.meta = [], [], []
        for i in range(cfg.num_hidden_layers):
            keys = min(context, cfg.window(i) or context)
            per_seq = -(-keys // page)
            shape = (1 + batch * per_seq, page, shard.num_key_value_heads, cfg.head_dim)
            self.k.append(torch.empty(shape, dtype=dt, device=dev).normal_(generator=gen))
            self.v.append(torch.empty(shape, dtype=dt, device=dev).normal_(generator=gen))
            table = 1 + torch.arange(batch * per_seq, device=dev).view(batch, per_seq)
            base = torch.full((batch,), context - keys, dtype=torch.long, device=dev)
            slots = table[:, (keys - 1) // page] * page + (keys - 1) % page
            self.meta.append((table, base, slots))

    def kv_cache(self, layer, v, batch):
        return self.k[layer], self.v[layer], self.meta[layer][2]

    def __call__(self, layer, q, window, scale, batch) -> torch.Tensor:
        table, base, _ = self.meta[layer]
        return self.ops.attention(q, self.k[layer], self.v[layer], table, base, self.q_seq,
                                  self.q_pos, window, scale)


@dataclass
class Workload:
    target: Target
    batch: int
    context: int
    layers: int
    model: BeamForCausalLM
    ids: torch.Tensor
    positions: torch.Tensor
    seq: Batch | None
    last: torch.Tensor  # index of each sequence's last token
    notes: list[str] = field(default_factory=list)
    graph: torch.cuda.CUDAGraph | None = None
    graph_note: str = ""

    @property
    def device(self) -> torch.device:
        return self.model.device

    def step(self) -> torch.Tensor:
        """One decode or prefill step -> FP32 logits of the last token of each sequence."""
        hidden = self.model.forward_tokens(self.ids, self.positions, self.seq)
        if self.target.phase == "prefill":
            hidden = hidden[self.last]
        return self.model.compute_logits(hidden)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def capture_graph(self) -> bool:
        """Capture the step in a CUDA graph where the runtime would (decode on a GPU)."""
        if self.device.type != "cuda" or self.target.phase != "decode":
            self.graph_note = "not captured: the runtime graphs decode steps on GPUs only"
            return False
        if self.model.ops.sources.get("moe_experts") == "reference":
            # Capturing a step that syncs with the host fails, and a failed capture can leave
            # the context unusable: do not try.
            self.graph_note = ("not capturable: the reference moe_experts synchronizes with the "
                               "host (torch.unique(...).tolist(), torch.where); timed eagerly")
            return False
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.step()
            self.synchronize()
        except Exception as e:  # noqa: BLE001 - any capture failure means eager timing
            self.graph_note = f"capture failed ({type(e).__name__}: {str(e).splitlines()[0]})"
            return False
        self.graph, self.graph_note = graph, "captured"
        return True


# ---- sizing ------------------------------------------------------------------------------------
def weight_bytes(target: Target, layers: int) -> int:
    """Bytes of one rank's weights at `layers` layers (built on the meta device)."""
    with torch.device("meta"):
        m = BeamForCausalLM(target.config(layers), target.shard)
    return sum(b.numel() * b.element_size() for b in m.buffers())


def kv_bytes(target: Target, batch: int, context: int, layers: int) -> int:
    if target.phase != "decode":
        return 0
    cfg, shard = target.config(layers), target.shard
    keys = sum(min(context, cfg.window(i) or context) for i in range(cfg.num_hidden_layers))
    return 2 * 2 * batch * keys * shard.num_key_value_heads * cfg.head_dim


def activation_bytes(target: Target, batch: int, context: int) -> int:
    """A generous bound on one step's live activations (the reference MoE holds [T, k, H] FP32)."""
    cfg, shard = target.config(), target.shard
    t = target.tokens(batch, context)
    moe = 6 * t * cfg.num_experts_per_tok * cfg.hidden_size
    attn = 8 * shard.num_attention_heads * cfg.head_dim * (context if target.phase == "decode"
                                                            else context * 4)
    return moe + attn + 6 * batch * shard.vocab_size + 2 * _GIB


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
def _fill_random(model: BeamForCausalLM, gen: torch.Generator) -> None:
    """Random weights in place: norm weights around 1, projections scaled by fan-in^-0.5."""
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


def resolve_ops(kernels: str, device: torch.device, registry: str | None = None) -> OpTable:
    """The op table for `reference`, `tuned` or a lock file, for this machine's arch; variants
    come from `registry` (default: the repo's kernels/)."""
    if kernels == "reference":
        return OpTable()
    try:
        from model.registry import resolve_ops as registry_resolve
    except ImportError as e:
        raise TargetError(f"--kernels {kernels} needs the kernel registry (model/registry/), "
                          f"which is not importable ({e}); use --kernels reference") from None
    # A lock file given by path (the optimize loop's trial of a run's new set) may select
    # verified candidates: profiling measures them; serving never loads them.
    return registry_resolve(kernels=kernels, registry=registry, device=device,
                            allow_candidates=kernels != "tuned")


def default_device(target: Target) -> torch.device:
    return torch.device("cpu" if target.hardware.is_cpu else "cuda")


def build_workload(target: Target, batch: int, layers: int | None = None,
                   context: int | None = None, kernels: str = "reference",
                   device: str | torch.device | None = None, seed: int = 0,
                   registry: str | None = None) -> Workload:
    """The model at the target's per-rank shapes with random weights, KV filled, inputs ready."""
    dev = torch.device(device) if device is not None else default_device(target)
    ctx = context or target.contexts[0]
    notes = []
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        n, why = plan_layers(target, batch, ctx, free, layers)
    else:
        n, why = layers or target.default_layers, f"{layers or target.default_layers} layers"
    notes.append(why)
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    start = time.perf_counter()
    ops = resolve_ops(kernels, dev, registry)
    with torch.device(dev):
        model = BeamForCausalLM(target.config(n), target.shard, ops=ops)
    _fill_random(model, gen)
    t = target.tokens(batch, ctx)
    ids = torch.randint(0, target.shard.vocab_size, (t,), device=dev, generator=gen)
    if target.phase == "decode":
        positions = torch.full((t,), ctx - 1, dtype=torch.long, device=dev)
        model.attention_backend = StaticKVAttention(model, batch, ctx, gen)
        seq, last = None, torch.arange(batch, device=dev)
    else:
        positions = torch.arange(ctx, device=dev).repeat(batch)
        bounds = [(i * ctx, (i + 1) * ctx) for i in range(batch)]
        seq = Batch(positions=positions, seq_bounds=bounds)
        last = torch.arange(1, batch + 1, device=dev) * ctx - 1
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    notes.append(f"built in {time.perf_counter() - start:.1f} s on {dev}")
    return Workload(target, batch, ctx, n, model, ids, positions, seq, last, notes)


def free_workload(work: Workload | None) -> None:
    """Drop the model and its cache and hand the memory back (before the next build)."""
    if work is None:
        return
    import gc

    work.graph = None
    work.model = None  # type: ignore[assignment]
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- the profiled process ------------------------------------------------------------------------
def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="One profiled step of a target (run under ncu).")
    p.add_argument("--target", required=True)
    p.add_argument("--batch", type=int, required=True)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--context", type=int, default=None)
    p.add_argument("--kernels", default="reference")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--registry", default=None, help="registry the kernels come from")
    p.add_argument("--warmup", type=int, default=1)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    from model.ops import set_nvtx

    a = _args(argv)
    work = build_workload(load_target(a.target), a.batch, a.layers, a.context, a.kernels,
                          seed=a.seed, registry=a.registry)
    for _ in range(a.warmup):  # outside the range: ncu skips these kernels
        work.step()
    work.synchronize()
    set_nvtx(True)
    with region(STEP_RANGE):
        work.step()
        work.synchronize()
    set_nvtx(False)
    print(f"autoopt workload: {a.target} batch {a.batch}, {work.layers} layers: step done")


if __name__ == "__main__":
    main()
