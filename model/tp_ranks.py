"""TP ranks that each hold their real slice of the model, built where they run.

    spec = RankModelSpec(config=preset("beam-1.0-501b"))     # random weights at each rank's shapes
    spec = RankModelSpec(path="ckpt")                         # or a checkpoint's slices
    out = run_on_ranks(bench_step, tp=8, spec=spec, args=(batch,))   # rank 0's return value

`run_on_ranks` starts the ranks (`model.parallel.launch`: NCCL on GPUs, gloo on CPU), builds each
rank's model and attaches the TP group (the one-shot boundary on NCCL, with its fallback), then
calls `fn(ctx, *args)` on every rank with a `RankContext` (group, model, notes). This is the
interface for a benchmark of the whole model under TP: `fn` times its step on every rank (the
ranks' collectives pair up) and rank 0's result comes back; `model.tp_measure` times a callable
the same way on every rank, and its `comm_floor` measures the cheapest exchange a boundary can
make, so that a TP step's floor is the per-rank floor plus `step_comm_floor_us`:

    def bench_rank(ctx, batches):             # module level: it is pickled to the ranks
        rows = []
        for b in batches:                     # every rank runs the same steps in the same order
            step = ...                        # this rank's decode step over ctx.model
            took = measure(step, ctx.group, warmup=2, repeats=10, inner=1)
            comm = comm_floor(ctx.group, b, ctx.model.config.hidden_size,
                              ctx.model.shard.vocab_size)
            rows.append((b, took, step_comm_floor_us(comm, ctx.model.config.num_hidden_layers)))
        return rows
    rows = run_on_ranks(bench_rank, 8, RankModelSpec(config=cfg, kernels="tuned"), args=(bs,))

Random weights are filled on the rank's device (the 52-layer TP8 rank of Beam is ~125 GB in BF16:
no host fill, no checkpoint on disk). Replicated tensors (norms, router) are the same on every
rank, so the router picks the same experts everywhere; sharded tensors are seeded per rank, so
a random TPn model is not a slice of a TP1 model (compare TP sizes on a written checkpoint). A
directory with config.json, the tokenizer and `random_weights.json` instead of weights
(`write_random_model_dir`) is loaded that way by `model.weights.load_model`, so `autoopt serve
--tp 8 --model DIR` and `generate --tp 8` serve the full-size model.
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .beam import BeamForCausalLM
from .config import BeamConfig
from .p2p import DEFAULT_CAPACITY
from .parallel import BACKENDS, BOUNDARIES, TPGroup, attach, launch

RANDOM_WEIGHTS = "random_weights.json"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


# ---- random weights at a rank's shapes ------------------------------------------------------
def _replicated(name: str) -> bool:
    return "norm" in name or "router" in name


def fill_random(model: BeamForCausalLM, seed: int) -> BeamForCausalLM:
    """Random weights in place on the model's device: norms around 1, projections scaled by
    fan-in^-0.5; replicated tensors equal on every rank, sharded ones seeded per rank."""
    dev = model.device
    for name, buf in model.named_buffers():
        key = zlib.crc32(name.encode())
        rank = 0 if _replicated(name) else model.rank + 1
        g = torch.Generator(device=dev).manual_seed((seed * 1_000_003 + key * 17 + rank) % 2**63)
        leaf = name.rsplit(".", 1)[-1]
        if leaf.endswith("norm"):
            buf.normal_(1.0, 0.2, generator=g)
        elif leaf == "router_bias":
            buf.normal_(0.0, 0.05, generator=g)
        elif leaf in ("gate_bias", "embed_tokens"):
            buf.normal_(0.0, 1.0, generator=g)
        else:
            buf.normal_(0.0, buf.shape[-1] ** -0.5, generator=g)
    return model


def random_rank_model(cfg: BeamConfig, tp: int, rank: int, device, dtype=torch.bfloat16,
                      seed: int = 0, ep: int = 1, ops=None) -> BeamForCausalLM:
    """Rank `rank` of a TP`tp` Beam with random weights, allocated and filled on `device`."""
    with torch.device(device):
        model = BeamForCausalLM(cfg, cfg.shard(tp, ep), rank=rank, dtype=dtype, ops=ops)
    return fill_random(model, seed)


def write_random_model_dir(path: str | Path, config: BeamConfig, seed: int = 0) -> Path:
    """config.json, generation_config.json, the tokenizer and random_weights.json: a model
    directory whose ranks build random weights at their shapes (no weights on disk)."""
    from .serve.tokenizer import write_tokenizer_files

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config.replace(extra={**config.extra, "dtype": "bfloat16"}).save(path / "config.json")
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
           "pad_token_id": config.pad_token_id, "do_sample": False}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    write_tokenizer_files(path, config.vocab_size)
    note = ("no weights: each tensor-parallel rank fills its slice with random values on its "
            "device (model/tp_ranks.py)")
    (path / RANDOM_WEIGHTS).write_text(json.dumps({"seed": seed, "note": note}, indent=2) + "\n")
    return path


def random_weights_seed(path: str | Path) -> int | None:
    """The seed of a random-weights model directory; None for a checkpoint."""
    marker = Path(path) / RANDOM_WEIGHTS
    if not marker.is_file():
        return None
    data = json.loads(marker.read_text())
    if not isinstance(data.get("seed"), int):
        raise ValueError(f"{marker} must hold an integer \"seed\", got {data.get('seed')!r}")
    return data["seed"]


# ---- running a function on every rank --------------------------------------------------------
@dataclass(frozen=True)
class RankModelSpec:
    """What each rank builds: random weights for `config`, or the slices of `path`."""

    config: BeamConfig | None = None
    path: str | None = None
    seed: int = 0
    dtype: str = "bfloat16"
    kernels: str = "tuned"  # reference | tuned | a lock file (model.registry.resolve_ops)
    registry: str | None = None
    boundary: str | None = None  # a BOUNDARIES name; None: oneshot on NCCL, gather on gloo
    max_tokens: int = DEFAULT_CAPACITY  # one-shot buffer rows

    def __post_init__(self) -> None:
        if (self.config is None) == (self.path is None):
            raise ValueError("RankModelSpec needs exactly one of config (random weights) and "
                             "path (a checkpoint or random-weights directory)")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.boundary is not None and self.boundary not in BOUNDARIES:
            raise ValueError(f"unknown TP boundary {self.boundary!r}; registered: "
                             f"{sorted(BOUNDARIES)}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass
class RankContext:
    """One rank's group and model, as `run_on_ranks` hands them to `fn`."""

    group: TPGroup
    model: BeamForCausalLM
    notes: list[str] = field(default_factory=list)


def build_rank(group: TPGroup, spec: RankModelSpec) -> RankContext:
    """This rank's model per `spec`, attached to `group` (collective: every rank calls it)."""
    start = time.perf_counter()
    dtype = DTYPES[spec.dtype]
    if spec.boundary is not None:
        group.boundary_impl = spec.boundary
    if spec.path is not None:
        from .weights import load_model

        model = load_model(spec.path, dtype=dtype, device=str(group.device), tp=group.size,
                           rank=group.rank, kernels=spec.kernels, registry=spec.registry)
        what = f"weights: {spec.path}"
    else:
        from .registry import resolve_ops

        ops = resolve_ops(spec.kernels, spec.registry, device=group.device, dtype=dtype)
        model = random_rank_model(spec.config, group.size, group.rank, group.device, dtype,
                                  spec.seed, ops=ops)
        what = f"weights: random (seed {spec.seed}) at rank {group.rank}'s shapes"
    attach(model, group, spec.max_tokens)
    if group.device.type == "cuda":
        torch.cuda.synchronize(group.device)
    size = sum(b.numel() * b.element_size() for b in model.buffers())
    notes = [what, f"{model.config.num_hidden_layers} layers, {size / 1e9:.2f} GB a rank, built "
             f"in {time.perf_counter() - start:.1f} s", f"TP{group.size}: {group.boundary_note}"]
    return RankContext(group, model, notes)


def _rank_entry(group: TPGroup, fn: Callable[..., Any], spec: RankModelSpec, args: tuple):
    return fn(build_rank(group, spec), *args)


def run_on_ranks(fn: Callable[..., Any], tp: int, spec: RankModelSpec, args: tuple = (),
                 backend: str | None = None, timeout_s: float | None = None,
                 pg_timeout_s: float = 300.0) -> Any:
    """`fn(ctx: RankContext, *args)` on each of `tp` ranks; rank 0's return value.

    fn must be defined at module level (it is pickled to spawned ranks) and return CPU objects.
    The backend defaults to NCCL when there are GPUs (one per rank), else gloo.
    """
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return launch(_rank_entry, tp, backend, args=(fn, spec, args), timeout_s=timeout_s,
                  pg_timeout_s=pg_timeout_s)[0]
