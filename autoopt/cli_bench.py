"""`autoopt bench`: `bench op` (one op's variants, the harness) and `bench model` (the served step).

`autoopt bench --op X ...` (no sub-command) is `autoopt bench op --op X ...`, as it always was.
Registered on the app by `autoopt/cli.py` through `register`.
"""

from __future__ import annotations

from pathlib import Path

import typer

from .console import make_console

console = make_console()

bench_app = typer.Typer(
    help="Time kernels: `bench op` (an op's variants against the reference and torch.compile) "
    "and `bench model` (the served step per kernel set, against its floor). `bench --op X` is "
    "`bench op --op X`.", invoke_without_command=True)


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")


def _fail(exc: BaseException, code: int = 2) -> typer.Exit:
    make_console(stderr=True).print(f"[red]error:[/] {exc}")
    return typer.Exit(code)


def _op_bench(op, variant, source, registry, target, tokens, device, warmup, iters, compile_,
              json_out) -> None:
    from .eval.commands import BenchArgs, bench_command

    args = BenchArgs(op, variant, source, registry, target, tokens, device, warmup, iters,
                     compile_, json_out)
    try:
        code = bench_command(args, console)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        raise _fail(exc) from None
    raise typer.Exit(code)


_OP = typer.Option(None, "--op", help="Op name (registry key), e.g. swiglu.")
_VARIANT = typer.Option(None, "--variant", help="Variant NAME (default: reference only).")
_SOURCE = typer.Option(None, "--source", help="A variant file outside any registry.")
_REGISTRY = typer.Option(None, "--registry", help="Registry DIR (default: kernels/).")
_TARGET = typer.Option(None, "--target", help="Target whose shapes to time.")
_TOKENS = typer.Option(None, help="Token counts, e.g. 1,8,32 (default: the op's).")
_DEVICE = typer.Option("auto", help="cpu, cuda or auto (cuda when present).")
_WARMUP = typer.Option(10, help="Warm-up calls before timing.")
_ITERS = typer.Option(50, help="Timed samples (graph replays on cuda).")
_COMPILE = typer.Option(True, "--compile/--no-compile",
                        help="Also time torch.compile of the reference.")
_JSON = typer.Option(False, "--json", help="Print the rows as JSON.")


@bench_app.callback()
def bench(ctx: typer.Context, op: str = _OP, variant: str = _VARIANT, source: Path = _SOURCE,
          registry: Path = _REGISTRY, target: str = _TARGET, tokens: str = _TOKENS,
          device: str = _DEVICE, warmup: int = _WARMUP, iters: int = _ITERS,
          compile_: bool = _COMPILE, json_out: bool = _JSON) -> None:
    """Time kernels (see the sub-commands); `bench --op X` times one op."""
    if ctx.invoked_subcommand is not None:
        return
    if op is None:
        console.print(ctx.get_help())
        raise _fail(ValueError("give --op OP (an op's variants) or a sub-command: bench op, "
                               "bench model --target T"))
    _op_bench(op, variant, source, registry, target, tokens, device, warmup, iters, compile_,
              json_out)


@bench_app.command("op")
def bench_op(op: str = typer.Option(..., "--op", help="Op name (registry key), e.g. swiglu."),
             variant: str = _VARIANT, source: Path = _SOURCE, registry: Path = _REGISTRY,
             target: str = _TARGET, tokens: str = _TOKENS, device: str = _DEVICE,
             warmup: int = _WARMUP, iters: int = _ITERS, compile_: bool = _COMPILE,
             json_out: bool = _JSON) -> None:
    """Time reference, torch.compile and a variant: median, IQR, ratios, % of floor."""
    _op_bench(op, variant, source, registry, target, tokens, device, warmup, iters, compile_,
              json_out)


def _ints(text: str | None, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in (text or "").split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, got {text!r}") from None


@bench_app.command("model")
def bench_model(
    target: str = typer.Option(None, "--target", help="Target (default: this GPU's decode "
                               "target, or cpu-tiny without a GPU)."),
    batch: str = typer.Option(None, "--batch", help="Batch sizes, e.g. 1,8,32,64 (default: "
                              "the target's)."),
    context: str = typer.Option(None, "--context", help="Contexts (decode: keys per sequence; "
                                "prefill: prompt tokens), e.g. 8192,100000 (default: the "
                                "target's first)."),
    layers: int = typer.Option(None, "--layers", help="Layers (default: the target's, or what "
                               "fits)."),
    kernels: str = typer.Option(None, "--kernels", help="Kernel sets: reference, "
                                "reference-graphs (the MoE's capturable library path, so the "
                                "step replays from CUDA graphs), tuned, compile, "
                                "tuned+compile (the lock, Inductor for the rest), or "
                                "lock file paths (a copy's registry.lock.toml reads that "
                                "copy's variants and configs: a before beside its after; "
                                "default: reference,tuned,compile on a GPU; reference,tuned on "
                                "the CPU)."),
    attention_backend: str = typer.Option("auto", "--attention-backend",
                                          help="auto, torch or flashinfer."),
    phase: str = typer.Option(None, "--phase", help="decode or prefill (default: the "
                              "target's; prefill runs 8 x 2048 tokens)."),
    model: str = typer.Option(None, "--model", help="Checkpoint (HF layout) instead of random "
                              "weights; rank 0 of the target's TP layout is loaded."),
    registry: Path = _REGISTRY,
    iters: int = typer.Option(None, "--iters", help="Timed steps per row (default 20 on a "
                              "GPU, 2 on the CPU)."),
    row_s: float = typer.Option(None, "--row-s", help="Stop a row's timed steps after this "
                                "many seconds, keeping at least 5 (an eager step at a large "
                                "batch takes seconds)."),
    proxy: bool = typer.Option(False, "--proxy", help="Run a GPU target on another GPU."),
    budget: str = typer.Option(None, "--budget", help="Stop starting new rows after this long "
                               "(30m, 90s)."),
    out: Path = typer.Option(None, "--out", help="Output DIR (default runs/<time>-bench-"
                             "<target>)."),
) -> None:
    """The served step per kernel set: ms per step against its floor, kernels per layer."""
    import time

    from . import env
    from .bench_model import BenchModelArgs, run_bench
    from .bench_model_report import print_result, write_outputs
    from .loop import default_target, parse_budget
    from .targets import TargetError

    try:
        name = target or default_target()
        args = BenchModelArgs(
            target=name, batches=_ints(batch, "--batch"), contexts=_ints(context, "--context"),
            layers=layers, kernels=tuple(k for k in (kernels or "").split(",") if k),
            attention_backend=attention_backend, phase=phase, model=model,
            registry=str(registry) if registry else None, iters=iters, row_s=row_s,
            proxy=proxy, budget_s=parse_budget(budget) if budget else None)
        res = run_bench(args, say=lambda line: console.print(line, highlight=False))
    except (TargetError, ValueError, FileNotFoundError, RuntimeError) as exc:
        raise _fail(exc) from None
    print_result(res, console)
    where = out or env.runs_dir() / f"{time.strftime('%Y%m%d-%H%M%S')}-bench-{res.target}"
    paths = write_outputs(res, where)
    console.print(f"wrote {paths['json']}, {paths['md']} and {paths['png']}")
