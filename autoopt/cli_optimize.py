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


def _options(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise _fail(ValueError(f"--agent-option {item!r} should be KEY=VALUE (e.g. "
                                   "trials=16); --agent-option help lists each agent's"))
        out[key.strip()] = value.strip()
    return out


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
    sessions: int = typer.Option(1, "--sessions", help="Agent sessions per op, at once, each "
                                 "with its own seed or strategy."),
    gpus: str = typer.Option(None, "--gpus", help="Local GPUs that evaluate candidates, one "
                             "worker each (0,1,...); default: every visible GPU."),
    workers: int = typer.Option(1, "--workers", help="Evaluation workers on a CPU run "
                                "(verification only, nothing timed)."),
    ray_address: str = typer.Option(None, "--ray-address", help="Evaluate on a Ray cluster: "
                                    "auto, HOST:PORT, ray://HOST:10001, or local (start one "
                                    "here for the run); tasks pinned to one GPU each."),
    agent_option: list[str] = typer.Option(None, "--agent-option", "-O", help="KEY=VALUE "
                                           "option the agent declares (repeat); `autoopt "
                                           "optimize --agent-option help` lists them."),
    trials: int = typer.Option(None, help="= -O trials=N (template agent: Optuna trials per "
                               "token bucket, default 8)."),
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
    model: str = typer.Option(None, help="= -O model=NAME (claude agent; default "
                              "claude-sonnet-5-5)."),
    max_turns: int = typer.Option(None, help="= -O max_turns=N (claude: API calls per "
                                  "session)."),
    max_tokens: int = typer.Option(None, help="= -O max_tokens=N (claude: tokens per reply)."),
    budget_usd: float = typer.Option(None, help="= -O budget_usd=X (claude: USD for the run, "
                                     "all sessions together)."),
) -> None:
    """Profile a target, let an agent write verified kernels for its slowest ops, report."""
    from .agents import AGENTS, default_agent, describe_options, parse_options
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
    if agent_option == ["help"]:
        for name, spec in AGENTS.items():
            console.print(f"{name}: {spec.summary}\n  options: "
                          f"{', '.join(describe_options(name))}")
        raise typer.Exit(0)
    try:
        if resume is not None:
            run_optimize(OptimizeArgs(), console, resume=resume)
            return
        raw = _options(agent_option or [])
        shorthands = {"trials": trials, "model": model, "max_turns": max_turns,
                      "max_tokens": max_tokens, "budget_usd": budget_usd}
        raw.update({k: v for k, v in shorthands.items() if v is not None})
        options = parse_options(agent or default_agent(), raw)
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
            runs_dir=str(runs_dir) if runs_dir else None, compile=compile_,
            verify_seeds=verify_seeds,
            verify_tokens=tuple(int(t) for t in (verify_tokens or "").split(",") if t),
            bench_iters=bench_iters, e2e=e2e, profile_backend=profile_backend, device=device,
            agent_options=options, sessions=sessions,
            gpus=tuple(int(g) for g in (gpus or "").split(",") if g.strip()), workers=workers,
            ray_address=ray_address)
        run_optimize(args, console)
    except (TargetError, MissingKeyError, ValueError, FileNotFoundError, RuntimeError) as exc:
        raise _fail(exc) from None
