"""`autoopt optimize`: the agent loop's flags.

Registered on the app by `autoopt/cli.py` through `register`, which keeps the `--help` order.
"""

from __future__ import annotations

from pathlib import Path

import typer

from .console import make_console

console = make_console()


def register(app: typer.Typer) -> None:
    """Add the `optimize` command to `app`."""
    app.command()(optimize)


# ---- optimize -------------------------------------------------------------------------------
def _fail(exc: BaseException, code: int = 2) -> typer.Exit:
    make_console(stderr=True).print(f"[red]error:[/] {exc}")
    return typer.Exit(code)


def optimize(
    target: str = typer.Option(None, "--target", help="Target (default: this GPU's decode "
                               "target, or cpu-tiny without a GPU)."),
    agent: str = typer.Option(None, "--agent", help="template or claude (default: claude when "
                              "ANTHROPIC_API_KEY is set, else template)."),
    ops: str = typer.Option(None, "--ops", help="Only these ops, comma-separated."),
    budget: str = typer.Option("30m", help="Wall-time budget of the whole command, profiling "
                               "and the end-to-end check included (30m, 90s); the plan is "
                               "printed first."),
    max_candidates: int = typer.Option(4, help="Proposals evaluated per op at most."),
    proxy: bool = typer.Option(False, "--proxy", help="Tune on this GPU at the target's shapes."),
    layers: int = typer.Option(None, help="Layers of the profiled step (default: target's)."),
    batch: int = typer.Option(None, help="Batch size of the profiled step (default: first)."),
    auto_accept: bool = typer.Option(False, "--auto-accept",
                                     help="Accept and lock GPU winners (never on the CPU)."),
    registry: Path = typer.Option(None, "--registry", help="Registry DIR (default: kernels/)."),
    runs_dir: Path = typer.Option(None, "--runs-dir", help="Where run dirs go (default: runs/)."),
    resume: Path = typer.Option(None, "--resume", help="Continue an interrupted RUN_DIR."),
    replay: Path = typer.Option(None, "--replay", help="Re-evaluate RUN_DIR's proposals (no "
                                "model calls, registry untouched); exit 1 if a verdict differs."),
    device: str = typer.Option(None, "--device", help="One worker on this device (cuda:1); "
                               "default: one worker per visible GPU."),
    trials: int = typer.Option(8, help="Optuna trials per token bucket (template agent)."),
    compile_: bool = typer.Option(False, "--compile/--no-compile",
                                  help="Also time torch.compile of the reference (slow)."),
    verify_seeds: int = typer.Option(3, help="Seeds per verification shape."),
    verify_tokens: str = typer.Option(None, help="Token counts of verify shapes (default: the "
                                      "harness's)."),
    bench_iters: int = typer.Option(50, help="Timed samples per benchmark."),
    e2e: bool = typer.Option(True, "--e2e/--no-e2e", help="End-to-end check of the new set "
                             "(bench model: reference vs tuned vs the run's set)."),
    profile_backend: str = typer.Option("auto", help="Profiler: auto or torch (torch.profiler);"
                                        " ncu adds a sampled Nsight Compute pass."),
    model: str = typer.Option(None, help="Claude model (default claude-sonnet-5-5)."),
    max_turns: int = typer.Option(None, help="Claude API calls per op at most."),
    max_tokens: int = typer.Option(None, help="Claude tokens per reply at most."),
    budget_usd: float = typer.Option(None, help="Claude cost budget for the run (USD)."),
) -> None:
    """Profile a target, let an agent write verified kernels for its slowest ops, report."""
    from .agents.claude import MissingKeyError
    from .loop import OptimizeArgs, default_target, parse_budget
    from .loop import optimize as run_optimize
    from .replay import replay as run_replay
    from .targets import TargetError

    if replay is not None:
        try:
            out, same = run_replay(replay, console, registry=str(registry) if registry else None,
                                   runs_dir=str(runs_dir) if runs_dir else None)
        except (TargetError, ValueError, FileNotFoundError, RuntimeError) as exc:
            raise _fail(exc) from None
        verdicts = "all verdicts reproduced" if same else "verdicts DIFFER"
        console.print(f"replay: {out} ({verdicts})")
        raise typer.Exit(0 if same else 1)
    try:
        if resume is not None:
            run_optimize(OptimizeArgs(), console, resume=resume)
            return
        name = target or default_target()
        if target is None:
            console.print(f"no --target given: using [bold]{name}[/]"
                          + (" (no GPU here: correctness only, timings not meaningful)"
                             if name == "cpu-tiny" else " (this GPU's target)"))
        args = OptimizeArgs(
            target=name, agent=agent, ops=tuple(o for o in (ops or "").split(",") if o),
            budget_s=parse_budget(budget), max_candidates=max_candidates, proxy=proxy,
            layers=layers, batch=batch, auto_accept=auto_accept,
            registry=str(registry) if registry else None,
            runs_dir=str(runs_dir) if runs_dir else None, trials=trials, compile=compile_,
            verify_seeds=verify_seeds,
            verify_tokens=tuple(int(t) for t in (verify_tokens or "").split(",") if t),
            bench_iters=bench_iters, e2e=e2e, profile_backend=profile_backend, device=device,
            model=model, max_turns=max_turns,
            max_tokens=max_tokens, budget_usd=budget_usd)
        run_optimize(args, console)
    except (TargetError, MissingKeyError, ValueError, FileNotFoundError, RuntimeError) as exc:
        raise _fail(exc) from None
