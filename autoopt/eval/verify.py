"""Verify a kernel variant against its op's reference: the judge, not the candidate, decides.

`verify_variant` runs in the judge (the calling process): it screens the source (nothing runs if
that fails), draws this run's secret, plans the shapes from the op contract and the target,
computes inputs and references itself, and drives a worker process (channel.py, worker.py) that
holds only the candidate and the inputs it is handed. The candidate's outputs come back as copies
and are judged here, per shape and per output (judgement.py), with the behavioural checks of
trials.py and followups.py. On cuda it also times the candidate with the judge's own clock
against the op's floor and runs compute-sanitizer's racecheck (races.py) on Triton and CuTe
variants; on CPU the kernel's programs run in shuffled orders under the interpreter and the
report says that shared-memory races were not checked. Every rejection reason names its check.
"""

from __future__ import annotations

import ast
import json
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .screen import ALLOWED_IMPORTS, ALLOWED_MODULES, static_screen

# A CPU worker never needs more address space than this; a runaway candidate is stopped by it.
CPU_MEM_LIMIT = 48 << 30


@dataclass
class VerifyReport:
    op: str
    source: str
    sha256: str
    device: str
    verdict: str  # "pass" | "reject"
    reasons: list[str]
    checks: dict[str, Any] = field(default_factory=dict)
    per_shape: list[dict] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)
    shapes: list[dict] = field(default_factory=list)
    config: dict | None = None
    configs: dict | None = None  # a config per bucket, picked call by call (run.PerBucket)
    elapsed_s: float = 0.0
    env: dict[str, Any] = field(default_factory=dict)
    secret: str = ""  # stated after the run, to reproduce it (`secret=`)

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=str)


def verify_variant(op: str, source: Path, *, device: str = "cpu",
                   seeds: Sequence[int] | int | None = None, shapes: list[dict] | None = None,
                   config: Any = None, timeout_s: float = 300, time_check: bool = True,
                   target: Any = None, budget: Any = None, secret: bytes | str | None = None,
                   racecheck: bool | None = None, memcheck: bool = False) -> VerifyReport:
    """Verify the variant file `source` for `op`; never raises for the candidate's faults.

    `config`: one config for every call (None: the variant's DEFAULT_CONFIG), or a
    `run.PerBucket` table whose configs the worker picks per call by token count, as serving.

    `seeds` gives how many seeds each bucket shape gets (a count, or a sequence whose length
    counts); the seeds themselves are drawn from this run's secret. `shapes` replaces the
    target's bucket shapes (drawn, long and edge-case shapes are always added). `target` (a name,
    a Target or a list) sets the GPU widths and buckets; by default cpu-tiny on CPU and every
    shipped target for the local GPU. `secret` reproduces a reported run. `racecheck` (cuda)
    defaults to on for Triton and CuTe variants. `memcheck` (cuda) also runs a Triton or CuTe
    variant under compute-sanitizer's memcheck with torch's caching allocator off (races.py).
    """
    from model.ops import contract

    from .candidates import sha256_file
    from .plan import Budget, Secret, default_targets, plan_shapes

    c = contract(op)  # unknown op: ValueError naming the known ones
    source = Path(source).resolve()
    if not source.is_file():
        raise FileNotFoundError(f"variant file {source} does not exist")
    text = source.read_bytes()
    budget = budget or Budget()
    if seeds is not None:
        n = seeds if isinstance(seeds, int) else len(seeds)
        budget = Budget(**{**asdict(budget), "seeds": max(1, n)})
    from .run import PerBucket

    per = config if isinstance(config, PerBucket) else None
    report = VerifyReport(op=op, source=str(source), sha256=sha256_file(source), device=device,
                          verdict="reject", reasons=[], config=per.single() if per else config,
                          configs=per.describe() if per else None)
    start = time.monotonic()
    screen = static_screen(text.decode("utf-8", "replace"), str(source))
    report.checks["static_screen"] = {"passed": not screen, "reasons": screen,
                                      "rule": "allowlist of modules, names and attributes"}
    if screen:
        report.reasons = screen
        report.elapsed_s = time.monotonic() - start
        return report
    s = Secret(secret)
    targets = _targets(target, device) or default_targets(device)
    plan = plan_shapes(c, device, targets, shapes, budget, s)
    report.checks["plan"] = plan.describe()
    report.shapes = plan.buckets + plan.drawn + plan.long
    from .run import judge_candidate

    judge_candidate(report, c, text, plan, budget, s, config=config, timeout_s=timeout_s,
                    time_check=time_check, racecheck=racecheck, memcheck=memcheck)
    report.secret = s.hex
    report.elapsed_s = time.monotonic() - start
    report.verdict = "pass" if not report.reasons else "reject"
    return report


def _targets(target: Any, device: str) -> list[Any]:
    from autoopt.targets import Target, load_target

    if target is None:
        return []
    items = target if isinstance(target, list | tuple) else [target]
    out = [t if isinstance(t, Target) else load_target(t) for t in items]
    if device.startswith("cuda") and any(t.hardware.is_cpu for t in out):
        raise ValueError("a cpu target gives no GPU widths: pass a GPU target for --device cuda")
    return out


def preloads(source: str) -> list[str]:
    """Allowed modules the source imports (the worker imports them before arming its hook)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                if isinstance(node, ast.ImportFrom) and node.module else [])
        for m in mods:
            parts = m.split(".")
            for i in range(1, len(parts) + 1):
                p = ".".join(parts[:i])
                if p in ALLOWED_MODULES and p not in names and p != "__future__":
                    names.append(p)
    return names


def worker_imports() -> list[str]:
    return sorted(ALLOWED_IMPORTS)


def run_env(device: str) -> dict[str, Any]:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover
        triton_version = None
    gpu = torch.cuda.get_device_name() if device.startswith("cuda") else None
    return {"torch": torch.__version__, "triton": triton_version, "gpu": gpu,
            "python": platform.python_version(), "device": device}
