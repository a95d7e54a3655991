"""What every operation contract declares: numerics policy, near misses, axes and cost.

An op module (`model/ops/<op>.py`) exposes module-level names that `OpContract.from_module`
collects: `NAME`, `reference`, `make_inputs`, `AXES`, `NUMERICS`, `cost`, `SIGNATURE` and
`shapes_for` (the shapes a config/target gives the op), and optionally `INPLACE` (outputs that
are inputs updated in place, such as the KV cache the Q/K norm ops write: output index -> the
argument's name; the verifier compares them as outputs and requires them to be those inputs).
The model, the verifier, the benchmarks and the agents all read the same module, so there is
exactly one reference per operation.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

Shape = Mapping[str, int]


@dataclass(frozen=True)
class Numerics:
    """How a candidate's outputs are compared with the reference's.

    `bitwise`: every element identical. `ulp`: at most `max_ulp` BF16 ulps apart and at most
    `max_mismatch_fraction` of elements differing; the signed error must not be biased. Either
    way, a candidate must be strictly closer to the reference than to every near miss: the same
    op with one rounding point dropped or moved, or with an FMA, which a careless kernel computes.

    `magnitude(*inputs)`, when given, returns a tensor broadcastable to each output: ulps are
    then counted in units of the last place of max(|reference|, magnitude). For outputs that are
    sums whose terms can cancel (the MoE combine): a legitimate one-ulp change in one term moves
    a near-zero sum by arbitrarily many of its own ulps, but by at most one ulp of the terms.
    """

    kind: str  # "bitwise" | "ulp"
    max_ulp: int = 0
    max_mismatch_fraction: float = 0.0
    near_misses: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    # Integer outputs (expert ids) are compared exactly whatever `kind` says.
    note: str = ""
    magnitude: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("bitwise", "ulp"):
            raise ValueError(f"numerics kind must be 'bitwise' or 'ulp', not {self.kind!r}")


@dataclass(frozen=True)
class Cost:
    """Fewest bytes that must cross device memory and the FLOPs the op must do."""

    bytes: int
    flops: int = 0

    def floor_s(self, bandwidth_bytes_s: float, flops_s: float) -> float:
        return max(self.bytes / bandwidth_bytes_s, self.flops / flops_s if flops_s else 0.0)


@dataclass(frozen=True)
class OpContract:
    name: str
    reference: Callable[..., Any]
    make_inputs: Callable[..., tuple]
    axes: Mapping[str, str]
    numerics: Numerics
    cost: Callable[[Shape], Cost]
    signature: str
    shapes_for: Callable[..., dict[str, int]]
    module: ModuleType
    inplace: Mapping[int, str] = field(default_factory=dict)

    @property
    def token_dim(self) -> int:
        """Where T sits in the first argument's shape, read from SIGNATURE (`x[T,H]` -> 0,
        `partials[R,T,H]` -> 1): tuned configs are bucketed by T."""
        m = re.search(r"\[([^\]]*)\]", self.signature)
        dims = [d.strip() for d in m.group(1).split(",")] if m else []
        return dims.index("T") if "T" in dims else 0

    @classmethod
    def from_module(cls, module: ModuleType) -> OpContract:
        return cls(
            name=module.NAME,
            reference=module.reference,
            make_inputs=module.make_inputs,
            axes=module.AXES,
            numerics=module.NUMERICS,
            cost=module.cost,
            signature=module.SIGNATURE,
            shapes_for=module.shapes_for,
            module=module,
            inplace=dict(getattr(module, "INPLACE", {})),
        )


def gen(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def randn(
    shape: tuple[int, ...], g: torch.Generator, dtype: torch.dtype, device, scale: float = 1.0
):
    """Normal random tensor drawn on the CPU (reproducible across devices), then moved."""
    return (torch.randn(shape, generator=g, dtype=torch.float32) * scale).to(
        device=device, dtype=dtype
    )


def norm_weight(n: int, g: torch.Generator, dtype: torch.dtype, device) -> torch.Tensor:
    # Trained norm weights sit around 1 with spread; never all-ones (that hides a dropped multiply).
    return (1.0 + 0.3 * torch.randn(n, generator=g)).to(device=device, dtype=dtype)


def bf16_bytes(*numels: int) -> int:
    return 2 * sum(numels)
