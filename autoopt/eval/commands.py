"""`autoopt verify` and `autoopt bench`: argument resolution and printing (cli.py stays thin)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


@dataclass(frozen=True)
class VerifyArgs:
    op: str
    variant: str | None
    source: Path | None
    registry: Path | None
    device: str
    seeds: str
    tokens: str | None
    timeout: float
    json: bool
    target: str | None = None
    secret: str | None = None
    memcheck: bool = False
    config: str | None = None  # JSON: one config for every call
    configs: str | None = None  # JSON: {"T=1": {...}, "T=8": {...}}, picked per call


def parse_config(op: str, config: str | None, configs: str | None) -> Any:
    """--config JSON (one config), or --configs JSON (one per token bucket, "T=<n>" keys, each
    call given its nearest bucket's as serving does); None: the variant's DEFAULT_CONFIG."""
    from .run import PerBucket

    if config and configs:
        raise ValueError("give either --config (one for every call) or --configs (per bucket)")
    text = config or configs
    if not text:
        return None
    flag = "--config" if config else "--configs"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} must be JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, not {type(value).__name__}")
    if config:
        return value
    bad = [k for k, v in value.items()
           if not re.fullmatch(r"T=\d+", str(k)) or not (v is None or isinstance(v, dict))]
    if bad or not value:
        raise ValueError('--configs maps buckets to configs, e.g. {"T=1": {"BLOCK_N": 16}, '
                         f'"T=8": {{"BLOCK_N": 64}}}}; bad keys: {bad or "none given"}')
    per = PerBucket.of(op, value)
    if per is None:  # one distinct config: the same as --config
        return next(iter(value.values()))
    return per


@dataclass(frozen=True)
class BenchArgs:
    op: str
    variant: str | None
    source: Path | None
    registry: Path | None
    target: str | None
    tokens: str | None
    device: str
    warmup: int
    iters: int
    compile: bool
    json: bool


def resolve_device(device: str) -> str:
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"--device must be cpu, cuda or auto, not {device!r}")
    return device


def parse_ints(text: str | None, what: str) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers like 1,8,32, "
                         f"not {text!r}") from None


def resolve_source(op: str, variant: str | None, source: Path | None,
                   registry: Path | None) -> Path | None:
    """--source PATH, or DIR/OP/NAME.py with DIR = --registry or the default registry."""
    from autoopt.env import open_registry

    from .candidates import variant_path

    if source and variant:
        raise ValueError("give either --variant NAME (in a registry) or --source PATH, not both")
    if source:
        if not Path(source).is_file():
            raise FileNotFoundError(f"--source {source} does not exist")
        return Path(source)
    if variant:
        return variant_path(op, variant, open_registry(registry).root)
    return None


def verify_command(args: VerifyArgs, console: Console) -> int:
    from .verify import verify_variant

    device = resolve_device(args.device)
    source = resolve_source(args.op, args.variant, args.source, args.registry)
    if source is None:
        raise ValueError("autoopt verify needs --variant NAME or --source PATH")
    seeds = parse_ints(args.seeds, "--seeds") or [0, 1, 2]
    tokens = parse_ints(args.tokens, "--tokens")
    shapes = None
    if tokens:
        from .plan import default_targets
        from .shapes import target_shapes

        targets = [_load_target(args.target)] if args.target else default_targets(device)
        shapes = target_shapes(args.op, targets, tokens)
    if args.secret:
        try:
            bytes.fromhex(args.secret)
        except ValueError:
            raise ValueError(f"--secret must be the hex string a report states, not "
                             f"{args.secret!r}") from None
    config = parse_config(args.op, args.config, args.configs)
    report = verify_variant(args.op, source, device=device, seeds=len(seeds), shapes=shapes,
                            config=config, timeout_s=args.timeout, target=args.target,
                            secret=args.secret, memcheck=args.memcheck)
    if args.json:
        print(report.to_json())
    else:
        print_report(report, console)
    return 0 if report.passed else 1


def print_report(report, console: Console) -> None:
    color = "green" if report.passed else "red"
    console.print(f"[bold {color}]{report.verdict}[/] {report.op} {report.source} "
                  f"on {report.device} ({report.elapsed_s:.1f} s, sha256 {report.sha256[:12]})")
    for r in report.reasons:
        console.print(f"  [red]-[/] {r}")
    num = report.checks.get("numerics", {})
    for i, out in enumerate(num.get("outputs", [])):
        console.print(f"  output {i}: {out['mismatches']} of {out['elements']} differ, max "
                      f"{out['max_ulp']} ulp, policy {out['policy']}")
    for name, d in report.checks.get("near_misses", {}).get("by_name", {}).items():
        console.print(f"  near miss {name}: {d['status']}")


def _load_target(name: str):
    from autoopt.targets import load_target

    return load_target(name)


def bench_shapes(op: str, device: str, target: str | None, tokens: list[int] | None,
                 console: Console) -> list[dict]:
    from .shapes import default_shapes, target_shapes

    if not target:
        return default_shapes(op, device, tokens or ([1, 8, 32, 128] if device != "cpu" else None))
    try:
        from autoopt.targets import load_target
    except ImportError:
        console.print(f"[yellow]note:[/] autoopt.targets is not available; --target {target} "
                      f"ignored, using the default shapes")
        return default_shapes(op, device, tokens)
    t = load_target(target)
    if tokens:
        return target_shapes(op, [t], tokens)
    shapes = [t.op_shapes(b)[op] for b in t.batch_sizes if op in t.op_shapes(b)]
    if not shapes:
        raise ValueError(f"target {target} has no {op} call; pick another op or target")
    return shapes


def bench_command(args: BenchArgs, console: Console) -> int:
    from .timing import bench_op

    device = resolve_device(args.device)
    source = resolve_source(args.op, args.variant, args.source, args.registry)
    shapes = bench_shapes(args.op, device, args.target, parse_ints(args.tokens, "--tokens"),
                          console)
    rows = bench_op(args.op, source, shapes, device, warmup=args.warmup, iters=args.iters,
                    compile=args.compile)
    if args.json:
        print(json.dumps([r.to_dict() for r in rows], indent=2))
        return 0
    print_rows(rows, console)
    return 0


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_rows(rows, console: Console) -> None:
    if not rows:
        return
    r0 = rows[0]
    where = r0.gpu or "cpu (not meaningful for speed)"
    common = [n for n in r0.notes if all(n in r.notes for r in rows)]
    table = Table(title=f"{r0.op}: {r0.impl} on {where}, torch {r0.torch}, triton {r0.triton}, "
                        f"commit {(r0.git_commit or '?')[:10]}")
    for col in ("shape", "median µs", "IQR µs", "x reference", "x torch.compile", "GB/s",
                "% of floor", "notes"):
        table.add_column(col, justify="left" if col in ("shape", "notes") else "right")
    for r in rows:
        shape = ",".join(f"{k}={v}" for k, v in r.shape.items())
        table.add_row(shape, f"{r.median_us:.2f}", f"{r.iqr_us:.2f}", f"{r.x_reference:.2f}",
                      _fmt(r.x_compile, ".2f"), f"{r.gb_s:.1f}", f"{r.pct_of_floor:.1f}",
                      "; ".join(n for n in r.notes if n not in common))
    console.print(table)
    for n in common:
        console.print(f"note: {n}")
