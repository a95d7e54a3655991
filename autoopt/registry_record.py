"""Record a variant already in a registry (a hand-written one): verify, time, write the record.

`autoopt registry record OP VARIANT` and benchmarks/gpu_kernels.py both end in
`record_evidence`, which hands the judge's report and the timing rows to the registry's one
writer for this change (`model.registry.writers.record`): verification is kept per arch (this
machine's), benchmark rows per GPU. The judge is reached through two entry points only,
`autoopt.eval.verify_variant` and `autoopt.eval.bench_op`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from model.registry import Record, Registry, Verification, current_arch, writers


def verify(op: str, path: Path, device: str, seeds: int, shapes: list[dict] | None = None,
           timeout_s: float = 600, target: str | None = None,
           memcheck: bool = False) -> dict[str, Any]:
    """The judge's report on `path` (a dict): `seeds` secret seeds per shape; shapes None: the
    judge's defaults; `target` sets the GPU widths and token buckets; `memcheck` adds
    compute-sanitizer's memcheck on a GPU."""
    from autoopt.eval import verify_variant

    return verify_variant(op, path, device=device, seeds=seeds, shapes=shapes,
                          timeout_s=timeout_s, target=target, memcheck=memcheck).to_dict()


def bench_plan(op: str, device: str, target: str | None = None,
               tokens: Sequence[int] | None = None) -> list[tuple[str, dict]]:
    """(target name, shape) pairs to time: the target's shapes of `op` at its batch sizes, else
    the judge's default shapes for the device."""
    if target is None:
        from autoopt.eval import default_shapes

        label = "-" if device.startswith("cuda") else "cpu-tiny"
        return [(label, s) for s in default_shapes(op, device, list(tokens) if tokens else None)]
    from autoopt.targets import load_target

    t = load_target(target)
    shapes = [t.op_shapes(b)[op] for b in t.batch_sizes if op in t.op_shapes(b)]
    if not shapes:
        raise ValueError(f"target {t.name} has no {op} call; pick another op or target")
    return [(t.name, dict(s)) for s in shapes]


def bench(op: str, path: Path, plan: Sequence[tuple[str, dict]], device: str, *,
          warmup: int = 10, iters: int = 50, compile: bool = True, timeout_s: float = 900,
          on_rows: Callable[[list[dict[str, Any]]], None] | None = None) -> list[dict[str, Any]]:
    """Timing rows of reference, torch.compile and the variant, each labelled with its target.
    `on_rows(rows so far)` after each shape: a caller cut off keeps what was timed."""
    from autoopt.eval import bench_op

    targets = {json.dumps(s, sort_keys=True): t for t, s in plan}
    out: list[dict[str, Any]] = []

    def labelled(row) -> None:
        d = row.to_dict()
        out.append({**d, "target": targets.get(json.dumps(d["shape"], sort_keys=True), "-")})
        if on_rows is not None:
            on_rows(list(out))

    bench_op(op, path, [s for _, s in plan], device, warmup=warmup, iters=iters,
             compile=compile, timeout_s=timeout_s, on_row=labelled)
    return out


def record_evidence(reg: Registry, op: str, name: str, device: str, report: Mapping[str, Any],
                    rows: Sequence[Mapping[str, Any]], agent: str = "hand-written",
                    drop_gpus: Sequence[str] = ()) -> Record:
    """Write the report (as this machine's arch's verification) and rows into the record (and
    drop the rows of `drop_gpus` that no new row replaces). A report that names no file hash is
    taken to be of the file as it is now."""
    sha = reg.read_variant(op, name)[0].sha256
    check = Verification.from_report(current_arch(device), report, sha, f"{op}/{name}.py")
    return writers.record(reg, op, name, [check], rows, agent, drop_gpus)


@dataclass(frozen=True)
class RecordArgs:
    op: str
    variant: str
    device: str = "auto"
    seeds: int = 3
    tokens: tuple[int, ...] = ()
    target: str | None = None
    bench: bool = True
    warmup: int = 10
    iters: int = 50
    compile: bool = True
    timeout_s: float = 600
    agent: str = "hand-written"


def record_variant(reg: Registry, args: RecordArgs) -> tuple[Record, dict, list[dict]]:
    """Verify and (unless args.bench is False, or it was rejected) time a registry variant on
    this machine, and record both."""
    from autoopt.eval.commands import resolve_device

    device = resolve_device(args.device)
    variant = reg.read_variant(args.op, args.variant)[0]  # a safe file, or a clear error
    arch = current_arch(device)
    if (arch == "cpu" and not variant.runs_on_cpu) or (variant.archs and arch not in
                                                       variant.archs and arch != "cpu"):
        raise ValueError(f"{args.op}/{args.variant} ({variant.language}) runs on "
                         f"{', '.join(variant.archs or ['GPUs'])} only, not on {arch}: record it "
                         "on such a GPU (--device cuda there)")
    path = reg.variant_path(args.op, args.variant)
    from autoopt.eval import default_shapes

    shapes = default_shapes(args.op, device, list(args.tokens) or None)
    report = verify(args.op, path, device, args.seeds, shapes, args.timeout_s, args.target)
    rows: list[dict] = []
    if args.bench and report.get("verdict") == "pass":
        plan = bench_plan(args.op, device, args.target, args.tokens or None)
        rows = bench(args.op, path, plan, device, warmup=args.warmup, iters=args.iters,
                     compile=args.compile, timeout_s=args.timeout_s)
    rec = record_evidence(reg, args.op, args.variant, device, report, rows, args.agent)
    return rec, report, rows


@dataclass(frozen=True)
class TuneArgs:
    op: str
    variant: str
    configs: Mapping[str, Mapping[str, Any] | None]  # "T=1" -> config (None: DEFAULT_CONFIG)
    device: str = "auto"
    seeds: int = 2
    target: str | None = None
    warmup: int = 10
    iters: int = 50
    timeout_s: float = 600
    source: str | None = None  # where the configs came from (a sweep's results.json), as text


def bucket_shapes(op: str, device: str, target: str | None,
                  tokens: Sequence[int]) -> list[tuple[int, dict[str, int]]]:
    """(token count, shape) for every shape of the op at each count: at `target`'s widths, else
    the judge's defaults for this device (the shapes the configs are keyed and timed at; an op
    called at two widths, such as swiglu's dense and expert MLPs, has both)."""
    from autoopt.eval.shapes import default_shapes, target_shapes

    out: list[tuple[int, dict[str, int]]] = []
    for n in tokens:
        if target is None:
            shapes = default_shapes(op, device, [n])
        else:
            from autoopt.targets import load_target

            shapes = target_shapes(op, [load_target(target)], [n])
        if not shapes:
            raise ValueError(f"{op} has no shape at T={n} on {target or device}")
        out += [(n, dict(s)) for s in shapes]
    return out


def tune_variant(reg: Registry, args: TuneArgs) -> tuple[Record | None, dict, list[dict], str]:
    """Verify a recorded variant with a config per token bucket (each call gets its nearest
    bucket's, as serving picks), time each bucket's shape with its config beside the default,
    and propose the configs in the record (`accept` moves them to configs/ and the lock pins
    them). On a GPU a config slower than the default at its own shape is proposed as the
    default there ({}), and said so. Nothing is written when the judge rejects the configs, or
    when no config is left faster. Returns (record or None, report, rows, what happened)."""
    from autoopt.eval.commands import resolve_device
    from autoopt.eval.run import PerBucket
    from model.registry.configs import ConfigTable, parse_bucket

    device = resolve_device(args.device)
    rec = reg.read_record(args.op, args.variant)
    if rec is None:
        raise ValueError(f"{args.op}/{args.variant} has no record: record it first "
                         f"(autoopt registry record {args.op} {args.variant})")
    variant = reg.read_variant(args.op, args.variant)[0]
    if rec.variant.sha256 != variant.sha256:
        raise ValueError(f"{args.op}/{args.variant}.py changed since it was recorded")
    arch = current_arch(device)
    if arch == "cpu" and not variant.runs_on_cpu:
        raise ValueError(f"{args.op}/{args.variant} ({variant.language}) does not run on CPU: "
                         "tune it on its GPU (--device cuda there)")
    if not args.configs:
        raise ValueError("no configs to tune: give a config per bucket, e.g. "
                         '\'{"T=1": {"BLOCK_N": 4}}\'')
    bad = [b for b, c in args.configs.items() if c is not None and not isinstance(c, Mapping)]
    if bad:
        raise ValueError(f"each bucket's config must be a JSON object or null; not at {bad}")
    per_token = {parse_bucket(b): (dict(c) if c else None) for b, c in args.configs.items()}
    shapes = bucket_shapes(args.op, device, args.target, sorted(per_token))
    per = PerBucket.of(args.op, {f"T={n}": c for n, c in per_token.items()},
                       served_shapes=[s for _, s in shapes])
    path = reg.variant_path(args.op, args.variant)
    from autoopt.eval import verify_variant

    report = verify_variant(args.op, path, device=device, seeds=args.seeds,
                            config=per, timeout_s=args.timeout_s, target=args.target).to_dict()
    if report.get("verdict") != "pass":
        return None, report, [], "rejected with these configs: nothing written"
    from autoopt.eval import bench_op

    rows: list[dict] = []
    for n, shape in shapes:
        for label, cfg in (("default", None), ("tuned", per_token[n])):
            (row,) = bench_op(args.op, path, [shape], device, warmup=args.warmup,
                              iters=args.iters, compile=False, config=cfg,
                              timeout_s=args.timeout_s)
            rows.append({**row.to_dict(), "config": dict(cfg or {}), "label": label,
                         "target": args.target or "-"})
    meaningful = all(r.get("meaningful") for r in rows)
    # A null bucket hands the calls nearest it back to the file's defaults (it bounds the tuned
    # configs below it): its two rows run the same config, so their order is noise, not a verdict.
    # A config slower than the defaults at its own shape is not proposed there: that shape keeps
    # the defaults ({}), and the other buckets' wins stand. Nothing is written when none is left.
    slower = [i for i, ((n, _), d, r) in enumerate(zip(shapes, rows[::2], rows[1::2],
                                                        strict=True))
              if meaningful and per_token[n] and r["median_us"] > d["median_us"]]
    said = [f"T={rows[2 * i + 1]['shape']['T']}: {rows[2 * i + 1]['median_us']:.2f} us tuned "
            f"against {rows[2 * i]['median_us']:.2f}" for i in slower]
    if slower and all(not per_token[n] or i in slower for i, (n, _) in enumerate(shapes)):
        return None, report, rows, ("no tuned config is faster than the defaults at its own "
                                    f"bucket ({'; '.join(said)}): nothing written")
    tuned = [{**r, "config": {}} if i in slower else r
             for i, r in enumerate(x for x in rows if x["label"] == "tuned")]
    gpu = tuned[0].get("gpu") or "cpu"
    table = ConfigTable.from_rows(args.op, gpu, tuned)
    from autoopt.review import slim_report

    outside = outside_space(path.read_text(), per_token)
    rec = writers.tune(reg, args.op, args.variant, table, {
        "gpu": gpu, "device": device, "target": args.target, "speed_judged": meaningful,
        "source": args.source, "verification": [slim_report(report)], "benchmarks": rows,
        **({"outside_config_space": outside} if outside else {}),
        **({"kept_defaults": said} if said else {})})
    why = "" if meaningful else " (timings not meaningful here: speed not judged)"
    beyond = (f"; beyond the file's CONFIG_SPACE (verified as given): {', '.join(outside)}"
              if outside else "")
    kept = (f"; kept at the defaults, slower tuned ({'; '.join(said)})" if said else "")
    return rec, report, rows, (f"proposed configs for {gpu}{why}; `accept` moves them to "
                               f"configs/{beyond}{kept}")


def outside_space(source: str, per_token: Mapping[int, Mapping | None]) -> list[str]:
    """'T=1 BLOCK_N=1' for each tuned value the variant's CONFIG_SPACE does not list. The space
    is what the template agent searches, not a rule: a hand sweep may go past it, and the judge
    verifies whatever configs it is given, but the proposal says so for the reviewer."""
    from autoopt.agents.template import _module_literal

    try:
        space = _module_literal(source, "CONFIG_SPACE")
    except (SyntaxError, ValueError):
        space = None
    if not isinstance(space, Mapping):
        return []
    return [f"T={n} {k}={v}" for n, cfg in sorted(per_token.items()) for k, v in
            sorted((cfg or {}).items()) if k not in space or v not in space[k]]
