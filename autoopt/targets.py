"""Optimization targets: `tasks/<name>.toml` -> `Target`.

A target names the hardware (GPU, arch, datasheet HBM and BF16 rates, which measured ceilings
replace when the GPU is present), the parallel layout, the phase, batch sizes, context lengths,
the model preset and an optional layer count for quick proxies. Every shape derives from
`model.config` (the preset, sharded by the layout) and the op contracts' `shapes_for`.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from model.config import BeamConfig, ShardSpec, preset
from model.ops import CONTRACTS, Cost

from . import env

PHASES = ("decode", "prefill")
_ARCH = re.compile(r"^(sm_\d{2,3}a?|cpu)$")
_TOP_KEYS = {"name", "description", "model", "phase", "batch_sizes", "contexts", "layers",
             "hardware", "parallel"}
_HW_KEYS = {"gpu", "arch", "hbm_tb_s", "bf16_tflop_s", "fp32_tflop_s", "memory_gb"}
_PAR_KEYS = {"tp", "ep"}
# Named model regions that are not op contracts (model.beam wraps them in `region(...)`), plus
# the served step's attention backend (its range holds the attention op; the KV write is part of
# the Q/K norm ops).
REGIONS = ("embed", "rope_tables", "o_proj", "dense_gate_up", "dense_down", "lm_head",
           "paged_attention")


class TargetError(ValueError):
    """A target that cannot be loaded or used: says what was wrong and what to do."""


@dataclass(frozen=True)
class Hardware:
    gpu: str  # device name as torch reports it ("NVIDIA H200"); "cpu" for CPU targets
    arch: str  # sm_90, sm_100, cpu
    hbm_tb_s: float
    bf16_tflop_s: float
    fp32_tflop_s: float
    memory_gb: float

    @property
    def is_cpu(self) -> bool:
        return self.gpu == "cpu"


@dataclass(frozen=True)
class OpCall:
    """`count` calls of `name` at `shape` in one step; `cost` is the contract's for one call;
    `touched` (moe_experts) the distinct experts each call's routing hit on this rank."""

    name: str
    shape: dict[str, int]
    count: int
    cost: Cost
    touched: tuple[int, ...] = ()


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    model: str
    phase: str
    batch_sizes: tuple[int, ...]
    contexts: tuple[int, ...]
    hardware: Hardware
    tp: int = 1
    ep: int = 1
    layers: int | None = None
    source: Path | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        where = f"target {self.name!r}" + (f" ({self.source})" if self.source else "")
        if self.phase not in PHASES:
            raise TargetError(f"{where}: phase {self.phase!r} is not one of {PHASES}")
        for key in ("batch_sizes", "contexts"):
            values = getattr(self, key)
            if not values or any(not isinstance(v, int) or v < 1 for v in values):
                raise TargetError(f"{where}: {key} must be a non-empty list of positive integers, "
                                  f"got {list(values)}")
        if not _ARCH.match(self.hardware.arch):
            raise TargetError(f"{where}: arch {self.hardware.arch!r} should look like sm_90, "
                              "sm_100 or cpu")
        for key in ("hbm_tb_s", "bf16_tflop_s", "fp32_tflop_s", "memory_gb"):
            if not getattr(self.hardware, key) > 0:
                raise TargetError(f"{where}: hardware.{key} must be positive")
        try:
            cfg = preset(self.model)
            cfg.shard(self.tp, self.ep)
        except ValueError as e:
            raise TargetError(f"{where}: {e}") from None
        if self.layers is not None and not 1 <= self.layers <= cfg.num_hidden_layers:
            raise TargetError(f"{where}: layers={self.layers} must be within 1.."
                              f"{cfg.num_hidden_layers} (the preset's layer count)")

    # ---- model shapes -----------------------------------------------------------------------
    @property
    def default_layers(self) -> int:
        return self.layers or preset(self.model).num_hidden_layers

    def config(self, layers: int | None = None) -> BeamConfig:
        """The preset with `layers` (default: the target's layer count) layers."""
        cfg = preset(self.model)
        n = layers or self.default_layers
        if not 1 <= n <= cfg.num_hidden_layers:
            raise TargetError(f"layers={n} must be within 1..{cfg.num_hidden_layers} for "
                              f"{self.name}")
        return cfg if n == cfg.num_hidden_layers else cfg.replace(num_hidden_layers=n)

    def kind_layers(self) -> int:
        """The fewest leading layers that hold every layer kind (dense/MoE MLP, sliding/full
        attention) of the target's model."""
        cfg = self.config()
        want = set(zip(cfg.layer_types, cfg.mlp_layer_types))
        seen: set[tuple[str, str]] = set()
        for i, kind in enumerate(zip(cfg.layer_types, cfg.mlp_layer_types)):
            seen.add(kind)
            if seen == want:
                return i + 1
        return cfg.num_hidden_layers

    @property
    def shard(self) -> ShardSpec:
        return preset(self.model).shard(self.tp, self.ep)

    def tokens(self, batch: int, context: int | None = None) -> int:
        """Tokens through the model in one step: one per sequence (decode) or whole prompts."""
        return batch if self.phase == "decode" else batch * (context or self.contexts[0])

    def op_shapes(self, batch: int, context: int | None = None,
                  layers: int | None = None) -> dict[str, dict[str, int]]:
        """One call's shape for every op the served step calls at `batch` (attention: a
        full-attention layer's), and for the parts of a composite op it calls (they run inside
        it until a kernel of the composite is locked). Shapes do not depend on the layer count,
        so the step recorded has only as many layers as hold every layer kind (default)."""
        shapes: dict[str, dict[str, int]] = {}
        for call in self.step_calls(batch, layers=layers or self.kind_layers(), context=context):
            full_attention = call.name == "attention" and call.shape.get("W") == 0
            if call.name in CONTRACTS and (call.name not in shapes or full_attention):
                shapes[call.name] = call.shape
        cfg, shard = self.config(), self.shard
        for name in list(shapes):
            for part in CONTRACTS[name].parts:
                if part not in shapes:
                    shapes[part] = dict(CONTRACTS[part].shapes_for(cfg, shapes[name]["T"], shard))
        return shapes

    def step_calls(self, batch: int, layers: int | None = None,
                   context: int | None = None) -> list[OpCall]:
        """Every op and region call of one served step with its cost, recorded from the forward
        the serving engine runs (autoopt/profiler/inventory.py; on the meta device)."""
        from .profiler.inventory import step_inventory

        return step_inventory(self, batch, layers, context)

    def token_buckets(self) -> tuple[int, ...]:
        """Token counts the target's steps run ops at: the CUDA-graph batch buckets a GPU decode
        server replays (up to the largest batch size), the batch sizes on a CPU (no graphs
        there), or whole prompts in prefill."""
        if self.phase == "prefill":
            return tuple(sorted({self.tokens(b, c) for b in self.batch_sizes
                                 for c in self.contexts[:1]}))
        if self.hardware.is_cpu:
            return tuple(sorted(set(self.batch_sizes)))
        from model.serve.graphs import batch_buckets

        sizes = set(batch_buckets(max(self.batch_sizes))) | set(self.batch_sizes)
        return tuple(sorted(sizes))

    # ---- the machine --------------------------------------------------------------------------
    def require_local_gpu(self, proxy: bool = False) -> str | None:
        """Check that this machine can run the target; returns the proxy note, if a proxy.

        A GPU target runs on its GPU, or with `proxy` on another CUDA GPU at the target's
        per-rank shapes (then every record says "proxy for <target> measured on <gpu>").
        """
        if self.hardware.is_cpu:
            return None
        import torch

        if not torch.cuda.is_available():
            raise TargetError(
                f"target {self.name} needs a CUDA GPU ({self.hardware.gpu}) and this machine has "
                "none; run it on that GPU, or on another CUDA GPU with --proxy; without a GPU use "
                "the cpu-tiny target")
        local = torch.cuda.get_device_name()
        if gpu_matches(self.hardware.gpu, local):
            return None
        if not proxy:
            raise TargetError(
                f"target {self.name} is for {self.hardware.gpu} but this machine has {local}; "
                f"pass --proxy to measure at {self.name}'s per-rank shapes on {local} (the "
                "records will say so), or pick a target for this GPU (autoopt targets)")
        return f"proxy for {self.name} measured on {local}"


def gpu_matches(wanted: str, local: str) -> bool:
    """'NVIDIA H200' matches 'NVIDIA H200' and 'NVIDIA H200 NVL', not 'NVIDIA H100'."""
    model = " ".join(wanted.replace("NVIDIA", "").lower().split())
    return bool(model) and f" {model} " in f" {' '.join(local.lower().split())} "


def linear_cost(rows: int, k: int, n: int) -> Cost:
    """A BF16 `[rows, k] @ [n, k]^T`: read both operands and write the output once."""
    return Cost(bytes=2 * (rows * k + n * k + rows * n), flops=2 * rows * k * n)


# ---- loading ----------------------------------------------------------------------------------
def _check_keys(where: str, table: dict, allowed: set[str], section: str = "") -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise TargetError(f"{where}: unknown key(s) {unknown} in {section or 'the top level'}; "
                          f"allowed: {sorted(allowed)}")


def target_from_dict(data: dict[str, Any], source: Path | None = None) -> Target:
    where = str(source or data.get("name", "<target>"))
    _check_keys(where, data, _TOP_KEYS)
    hw, par = data.get("hardware"), data.get("parallel", {})
    if not isinstance(hw, dict):
        raise TargetError(f"{where}: a [hardware] table is required (keys {sorted(_HW_KEYS)})")
    _check_keys(where, hw, _HW_KEYS, "[hardware]")
    _check_keys(where, par, _PAR_KEYS, "[parallel]")
    missing = [k for k in ("name", "model", "phase", "batch_sizes", "contexts") if k not in data]
    missing += [f"hardware.{k}" for k in sorted(_HW_KEYS) if k not in hw]
    if missing:
        raise TargetError(f"{where}: missing required key(s) {missing}")
    try:
        hardware = Hardware(gpu=str(hw["gpu"]), arch=str(hw["arch"]),
                            **{k: float(hw[k]) for k in _HW_KEYS - {"gpu", "arch"}})
        return Target(
            name=str(data["name"]), description=str(data.get("description", "")),
            model=str(data["model"]), phase=str(data["phase"]),
            batch_sizes=tuple(data["batch_sizes"]), contexts=tuple(data["contexts"]),
            hardware=hardware, tp=int(par.get("tp", 1)), ep=int(par.get("ep", 1)),
            layers=data.get("layers"), source=source)
    except (TypeError, ValueError) as e:
        if isinstance(e, TargetError):
            raise
        raise TargetError(f"{where}: {e}") from None


def target_dirs(tasks: Path | None = None) -> list[Path]:
    """Where targets are looked up by name: `tasks`, else env.tasks_dirs() (the user's, then
    the shipped ones)."""
    return [Path(tasks)] if tasks is not None else env.tasks_dirs()


def target_paths(tasks: Path | None = None) -> dict[str, Path]:
    """{name: file} of every target in the lookup directories; an earlier directory wins."""
    found: dict[str, Path] = {}
    for folder in target_dirs(tasks):
        for p in sorted(folder.glob("*.toml")):
            found.setdefault(p.stem, p)
    return dict(sorted(found.items()))


def list_targets(tasks: Path | None = None) -> list[str]:
    """Names of the targets in the lookup directories, sorted; a TargetError saying where it
    looked when there are none."""
    names = list(target_paths(tasks))
    if not names:
        where = ", ".join(str(d) for d in target_dirs(tasks))
        raise TargetError(f"no targets (*.toml) found; looked in {where} (set AUTOOPT_TASKS, or "
                          "pass --target path/to/target.toml)")
    return names


def load_target(name_or_path: str | Path, tasks: Path | None = None) -> Target:
    """A target by name (the first `<name>.toml` in the lookup directories) or by TOML path."""
    path = Path(name_or_path)
    by_name = not (path.suffix == ".toml" or path.exists())
    if by_name:
        path = target_paths(tasks).get(str(name_or_path), path)
    if not path.is_file():
        known = ", ".join(target_paths(tasks)) or "none"
        where = (f"{name_or_path}.toml in " + ", ".join(str(d) for d in target_dirs(tasks))
                 if by_name else str(path))
        raise TargetError(f"no target {str(name_or_path)!r} (looked for {where}); known "
                          f"targets: {known}")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise TargetError(f"{path} is not valid TOML: {e}") from None
    return target_from_dict(data, source=path)
