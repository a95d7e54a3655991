"""What one verification runs, decided in the judge from a secret drawn for this run.

`Secret` holds 16 bytes from `os.urandom` (or given, to reproduce a reported run) and a PRNG
seeded from them; every seed, drawn token count, poison palette, changed element and the order
of calls comes from it, and the worker never sees it. The report states the secret after the
worker is gone.

`plan_shapes` picks the shapes from the op contract's test shapes (model/ops/_contract.py):
    buckets   the target's token buckets (on a GPU at the target's real widths: its config and
              TP/EP shard; on CPU the cpu-tiny buckets at the op's CPU widths), or the caller's
              shapes;
    drawn     token counts drawn log-uniformly from the op's whole token range (on CPU with the
              op's free widths drawn too; on a GPU each also once at the CPU shape with its free
              widths drawn, as no kernel expects);
    long      a token count beyond the largest bucket (on CPU in the top half of the range);
    edges     the contract's edge cases (zero rows, extreme magnitudes) at a small bucket.
`Budget` says how many of each, and how large the burst and follow-up checks are.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass, field
from typing import Any

import torch

from model.ops._contract import EdgeCase

CPU_TARGET = "cpu-tiny"
FALLBACK_GPU_TARGET = "h200-tp8-decode"


@dataclass(frozen=True)
class Budget:
    """How much one verification runs (the defaults; tests shrink the token caps)."""

    seeds: int = 3  # per bucket shape
    # Prefill-sized buckets (a million elements per output and more) get one seed: another seed
    # adds little evidence and, for heavy ops with a looping reference, minutes of GPU time.
    large_tokens: int = 4096
    large_seeds: int = 1
    drawn: int = 2  # token counts drawn from the op's range (one seed each)
    long: int = 1  # token counts beyond the largest bucket (one seed each)
    follow_ups: int = 2  # cases that get repeat, cache, dependence and order checks
    rechecks: int = 3  # earlier outputs re-read after later calls
    burst_sets: int = 12  # distinct input sets in the verification burst
    burst_reps: int = 2
    burst_samples: int = 4  # burst outputs checked
    # Fewer burst sets (never under two) where the sets would hold more than this: a MoE rank's
    # inputs are ~9 GiB a set, and the judge holds each set twice (old and refilled data).
    burst_bytes: int = 8 << 30
    filler: tuple[int, int] = (0, 2)  # extra calls at drawn token counts
    # Calls in a row at a small shape, early in the run (`followups.marathon`): for a time drawn
    # in this range (seconds; (0, 0): none), at most `marathon_calls`. A candidate exact for as
    # many calls as a verifier used to make has counted past them before the judged calls after.
    marathon_s: tuple[float, float] = (1.0, 3.0)
    marathon_calls: int = 200_000
    max_tokens: int | None = None  # cap on drawn and long token counts

    def __post_init__(self) -> None:
        if self.seeds < 1 or self.burst_sets < 2 or self.burst_samples < 1:
            raise ValueError("Budget needs seeds >= 1, burst_sets >= 2 and burst_samples >= 1")
        if not 0 <= self.marathon_s[0] <= self.marathon_s[1] or self.marathon_calls < 1:
            raise ValueError(f"Budget.marathon_s must be (lo, hi) with 0 <= lo <= hi and "
                             f"marathon_calls >= 1, not {self.marathon_s}, "
                             f"{self.marathon_calls}")
        if not 0 <= self.filler[0] <= self.filler[1]:
            raise ValueError(f"Budget.filler must be (lo, hi) with 0 <= lo <= hi, not "
                             f"{self.filler}")


class Secret:
    """The run's secret and everything drawn from it."""

    def __init__(self, secret: bytes | str | None = None) -> None:
        if isinstance(secret, str):
            secret = bytes.fromhex(secret)
        self.bytes = secret or os.urandom(16)
        self.rng = random.Random(int.from_bytes(self.bytes, "big"))

    @property
    def hex(self) -> str:
        return self.bytes.hex()

    def seed(self) -> int:
        return self.rng.getrandbits(62)

    def tokens(self, lo: int, hi: int) -> int:
        """Log-uniform in [lo, hi]: small decode counts and large prefill counts alike."""
        if hi <= lo:
            return lo
        return min(hi, max(lo, int(math.exp(self.rng.uniform(math.log(lo), math.log(hi + 1))))))

    def palette(self, dtype: torch.dtype) -> torch.Tensor:
        """Poison that looks like data: a sequence of normal values at a random scale (integers
        in a plausible id range for integer dtypes), of a random length (64k-256k). The
        worker fills free memory by tiling it from a random offset; the judge recognises
        unwritten output elements by runs of neighbours that are neighbours in the palette."""
        g = torch.Generator().manual_seed(self.seed())
        # Long enough that a window of it as large as an output never repeats.
        n = self.rng.randint(1 << 16, 1 << 18)
        if not dtype.is_floating_point:
            return torch.randint(0, 256, (n,), generator=g).to(dtype)
        scale = math.exp(self.rng.uniform(math.log(0.25), math.log(4.0)))
        return (torch.randn(n, generator=g) * scale).to(dtype)


@dataclass
class ShapePlan:
    kind: str  # "cpu" | "gpu"
    buckets: list[dict] = field(default_factory=list)
    drawn: list[dict] = field(default_factory=list)
    long: list[dict] = field(default_factory=list)
    edges: list[EdgeCase] = field(default_factory=list)
    targets: list[str] = field(default_factory=list)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "targets": self.targets, "buckets": self.buckets,
                "drawn": self.drawn, "long": self.long,
                "edges": [{"name": e.name, "shape": dict(e.shape)} for e in self.edges]}


def default_targets(device: str) -> list[Any]:
    """cpu-tiny on CPU; on a GPU every shipped target for this GPU (else the fallback)."""
    from autoopt.targets import gpu_matches, list_targets, load_target

    if not device.startswith("cuda"):
        return [load_target(CPU_TARGET)]
    local = torch.cuda.get_device_name(device)
    found = [t for t in (load_target(n) for n in list_targets())
             if not t.hardware.is_cpu and gpu_matches(t.hardware.gpu, local)]
    return found or [load_target(FALLBACK_GPU_TARGET)]


def _layouts(targets: list[Any], kind: str) -> list[tuple[Any, Any]]:
    if kind == "cpu":
        return [(None, None)]
    seen, out = set(), []
    for t in targets:
        key = (t.model, t.tp, t.ep)
        if key not in seen:
            seen.add(key)
            out.append((t.config(), t.shard))
    return out


def plan_shapes(contract: Any, device: str, targets: list[Any], shapes: list[dict] | None,
                budget: Budget, secret: Secret) -> ShapePlan:
    kind = "gpu" if device.startswith("cuda") else "cpu"
    tests = contract.tests
    plan = ShapePlan(kind, targets=[t.name for t in targets])
    layouts = _layouts(targets, kind)
    bucket_tokens = sorted({t.tokens(b) for t in targets for b in t.batch_sizes})
    if shapes:
        plan.buckets = [dict(s) for s in shapes]
    else:
        plan.buckets = [s for cfg, shard in layouts for t in bucket_tokens
                        for s in tests.at(cfg, shard, t, kind)]
    lo, hi = tests.token_range[kind]
    if budget.max_tokens:
        hi = max(lo, min(hi, budget.max_tokens))
    top = max([s.get("T", 1) for s in plan.buckets] + [1])
    for _ in range(budget.drawn):
        t = secret.tokens(lo, hi)
        for cfg, shard in layouts:
            for s in tests.at(cfg, shard, t, kind):
                plan.drawn.append(tests.vary(s, secret.rng.randint) if kind == "cpu" else s)
        if kind == "gpu" and tests.free_dims:
            # The target's widths are known to every kernel author: also one case at widths
            # nobody chose, so being exact only at the expected widths shows.
            plan.drawn += [tests.vary(s, secret.rng.randint) for s in tests.at(None, None, t,
                                                                               "cpu")]
    if top < hi:
        first = max(top + 1, hi // 2) if kind == "cpu" else top + 1
        for _ in range(budget.long):
            t = secret.rng.randint(first, hi)
            plan.long += [s for cfg, shard in layouts for s in tests.at(cfg, shard, t, kind)]
    base = [s for s in plan.buckets if s.get("T", 0) >= 2] or plan.buckets
    small = min(base, key=lambda s: s.get("T", 0))
    plan.edges = tests.edge_cases(small, kind, secret.tokens)
    return plan
