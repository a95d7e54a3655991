"""What every operation contract declares: numerics policy, near misses, axes and cost.

An op module (`model/ops/<op>.py`) exposes module-level names that `OpContract.from_module`
collects: `NAME`, `reference`, `make_inputs`, `AXES`, `NUMERICS`, `cost`, `SIGNATURE` and
`shapes_for` (the shapes a config/target gives the op), and optionally `INPLACE` (outputs that
are inputs updated in place, such as the KV cache the Q/K norm ops write: output index -> the
argument's name; the verifier compares them as outputs and requires them to be those inputs),
and `PARTS` with `compose(parts)` for a composite op (a fusion of other ops: while no variant is
selected for it, the op table builds it from its implementations of PARTS, so a selected kernel
of a part keeps running; `reference` is the composition of the parts' references).
The model, the verifier, the benchmarks and the agents all read the same module, so there is
exactly one reference per operation.

Test shapes (what the verifier runs; see `TestShapes`). An op module declares:
    CPU_DIMS      required: the fixed (non-token) dimensions used on CPU, where Triton kernels run
                  through the interpreter: narrow, but keeping every structural feature (GQA,
                  head_dim 128, the router's 8 groups of 32 experts).
    TOKEN_RANGE   optional: {"cpu": (lo, hi), "gpu": (lo, hi)}, the token counts the verifier may
                  draw (default `DEFAULT_TOKEN_RANGE`; lower the CPU bound when the reference or
                  an interpreted kernel is slow per token).
    FREE_DIMS     optional: {dim: (lo, hi)}: widths of the CPU shape the verifier may redraw, so
                  a kernel cannot be honest at the widths it expects alone: on CPU every drawn
                  case; on a GPU (where the buckets are the target's real widths) one extra case
                  per drawn token count, at CPU_DIMS with these widths redrawn.
    EDGE_SCALES   optional: {case name: {argument index: power-of-two factor}}: floating inputs
                  scaled to extreme magnitudes where the reference is still finite and defined
                  (a dropped eps shows at tiny inputs, an overflowing square at huge ones).
    EDGE_SHAPES   optional: {case name: {shape key: value}}: cases at the small bucket's shape
                  with these keys set (or added) that `make_inputs` reads: every value of a
                  small scalar domain (norm_residual_norm's depth index 2..105), or a layout the
                  served model uses but plain draws never make (moe_experts under expert
                  parallelism: ids of experts held by other ranks and a nonzero offset). A value
                  may also be a range drawn per run, log-uniformly, by the run's secret:
                  `(lo, hi)`, or `{"cpu": (lo, hi), "gpu": (lo, hi)}` by kind (attention's
                  context up to past the longest a target serves: a kernel that drops or
                  mishandles keys past some count shows, whatever the count).
    test_shapes   optional: test_shapes(cfg, shard, tokens, kind) -> [shape, ...] overriding the
                  default (`default_test_shapes`): one shape from CPU_DIMS on "cpu", the op's
                  `shapes_for` at the target's config and shard on "gpu".
Zero rows (T = 0) are always tried: where `make_inputs` and the reference run there, the contract
defines the answer (an empty output) and a candidate must give it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

Shape = Mapping[str, int]
KINDS = ("cpu", "gpu")
DEFAULT_TOKEN_RANGE: Mapping[str, tuple[int, int]] = {"cpu": (1, 512), "gpu": (1, 8192)}


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
    # Judge the sign of the errors (`autoopt/eval/numerics.py` bias test). Off where the
    # reference's own reduction is biased, so that a more exact honest order reads as a bias
    # (RMS over the hidden size: `BIASED_ROW_SUMS`), and a tight mismatch bound shows any
    # systematic error first.
    judge_bias: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ("bitwise", "ulp"):
            raise ValueError(f"numerics kind must be 'bitwise' or 'ulp', not {self.kind!r}")


BIASED_ROW_SUMS = (
    "no bias test: an FP32 sum of the squares of BF16 values is biased low, the more so the "
    "longer its sequential runs (the bits an add drops are not uniform: squares of 8-bit "
    "significands), from ~60% of rows below the exact sum for a tree to all of them for one run "
    "(tests/test_numerics_scales.py). The reference's reduction and a kernel's differ in run "
    "length, so an honest kernel's rsqrt, and every rounding after it, move one way against the "
    "reference: on an H200 one-pass kernels read as -0.13 to -0.83 ulp toward zero at every "
    "shape. The 0.1% mismatch bound shows any systematic error first.")


# An FP32 GEMM whose activations are BF16 (the router's) needs no FP32 FMA: the FP32 weight is
# exactly the sum of three BF16 terms (8 significant bits each: 24 in all), each BF16 x BF16
# product is exact in FP32, and tensor cores sum them in FP32. Three BF16 tensor-core products
# per FLOP beat the CUDA cores' FP32 FMAs several times over on Hopper, so the floor of such a
# GEMM is its FLOPs at the higher of the two rates; quoting the FMA rate alone would put the
# floor above a correct kernel and make the judge's floor check reject it.
BF16_TERMS_PER_FP32 = 3


def fp32_gemm_flops_s(bf16_flops_s: float, fp32_flops_s: float) -> float:
    """The rate an exact BF16 x FP32 GEMM can reach: FP32 FMAs or three-term BF16 products."""
    return max(fp32_flops_s, bf16_flops_s / BF16_TERMS_PER_FP32)


@dataclass(frozen=True)
class Cost:
    """Fewest bytes that must cross device memory and the FLOPs the op must do."""

    bytes: int
    flops: int = 0

    def floor_s(self, bandwidth_bytes_s: float, flops_s: float) -> float:
        return max(self.bytes / bandwidth_bytes_s, self.flops / flops_s if flops_s else 0.0)


@dataclass(frozen=True)
class EdgeCase:
    """An input the contract defines the answer for beyond plain random data: `shape` with the
    floating inputs at `scales` (argument index -> factor) multiplied by their factor."""

    name: str
    shape: Mapping[str, int]
    scales: Mapping[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for i, f in self.scales.items():
            if not (isinstance(i, int) and i >= 0 and f > 0):
                raise ValueError(f"edge case {self.name!r}: scales must map argument indices to "
                                 f"positive factors, got {dict(self.scales)}")

    def inputs(self, make_inputs: Callable[..., tuple], seed: int, device: Any) -> tuple:
        args = list(make_inputs(dict(self.shape), seed, device))
        for i, factor in self.scales.items():
            a = args[i]
            if isinstance(a, torch.Tensor) and a.dtype.is_floating_point:
                args[i] = (a.float() * factor).to(a.dtype)
        return tuple(args)


@dataclass(frozen=True)
class TestShapes:
    """What the verifier may run an op at (collected from the op module; see the docstring)."""

    __test__ = False  # not a pytest class
    cpu_dims: Mapping[str, int]
    token_range: Mapping[str, tuple[int, int]]
    edge_scales: Mapping[str, Mapping[int, float]]
    shapes: Callable[..., list[dict[str, int]]]
    free_dims: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    edge_shapes: Mapping[str, Mapping[str, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for kind in KINDS:
            lo, hi = self.token_range[kind]
            if not 1 <= lo <= hi:
                raise ValueError(f"TOKEN_RANGE[{kind!r}] must be 1 <= lo <= hi, got {(lo, hi)}")

    def at(self, cfg: Any, shard: Any, tokens: int, kind: str) -> list[dict[str, int]]:
        """Shapes at `tokens` for `kind` ("cpu": CPU_DIMS; "gpu": the config and shard)."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, not {kind!r}")
        return [dict(s) for s in self.shapes(cfg, shard, tokens, kind)]

    def vary(self, shape: Shape, draw: Callable[[int, int], int]) -> dict[str, int]:
        """`shape` with each FREE_DIMS width redrawn by `draw(lo, hi)` (CPU_DIMS shapes only)."""
        out = dict(shape)
        for dim, (lo, hi) in self.free_dims.items():
            if dim in out:
                out[dim] = draw(lo, hi)
        return out

    def edge_cases(self, shape: Shape, kind: str = "cpu",
                   draw: Callable[[int, int], int] | None = None) -> list[EdgeCase]:
        """Zero rows at `shape`, every declared magnitude case at `shape`, and every declared
        shape case (`shape` with its keys overridden; a range value drawn by `draw(lo, hi)`,
        its low end without one)."""
        cases = [EdgeCase("zero_rows", {**shape, "T": 0})]
        cases += [EdgeCase(name, dict(shape), dict(sc)) for name, sc in self.edge_scales.items()]
        for name, over in self.edge_shapes.items():
            values = {k: _edge_value(v, kind, draw) for k, v in over.items()}
            cases.append(EdgeCase(name, {**shape, **values}))
        return cases


def _edge_value(v: Any, kind: str, draw: Callable[[int, int], int] | None) -> int:
    """An EDGE_SHAPES value: an int as given; a range (by kind, if a dict) drawn."""
    if isinstance(v, Mapping):
        v = v[kind]
    if isinstance(v, tuple):
        lo, hi = v
        if not 1 <= lo <= hi:
            raise ValueError(f"an EDGE_SHAPES range must be 1 <= lo <= hi, got {v}")
        return draw(lo, hi) if draw else lo
    return int(v)


def default_test_shapes(module: ModuleType) -> Callable[..., list[dict[str, int]]]:
    def shapes(cfg: Any, shard: Any, tokens: int, kind: str) -> list[dict[str, int]]:
        if kind == "cpu":
            dims = getattr(module, "CPU_DIMS", None)
            if not dims:
                raise ValueError(f"op {module.NAME!r} declares no CPU_DIMS in {module.__name__}: "
                                 "add the fixed dimensions to verify it on CPU (see "
                                 "model/ops/_contract.py)")
            return [{"T": tokens, **dims}]
        return [dict(module.shapes_for(cfg, tokens, shard))]

    return shapes


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
    tests: TestShapes = field(default=None)  # type: ignore[assignment]  # set by from_module
    inplace: Mapping[int, str] = field(default_factory=dict)
    # A composite op (one boundary over other ops): the ops it is made of, and how the op table
    # builds it from its implementations of them while no variant is selected for it.
    parts: tuple[str, ...] = ()
    compose: Callable[[Mapping[str, Callable]], Callable] | None = None

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
            tests=TestShapes(
                cpu_dims=dict(getattr(module, "CPU_DIMS", {})),
                token_range={**DEFAULT_TOKEN_RANGE, **getattr(module, "TOKEN_RANGE", {})},
                edge_scales=dict(getattr(module, "EDGE_SCALES", {})),
                shapes=getattr(module, "test_shapes", None) or default_test_shapes(module),
                free_dims=dict(getattr(module, "FREE_DIMS", {})),
                edge_shapes=dict(getattr(module, "EDGE_SHAPES", {})),
            ),
            inplace=dict(getattr(module, "INPLACE", {})),
            parts=tuple(getattr(module, "PARTS", ())),
            compose=getattr(module, "compose", None),
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
