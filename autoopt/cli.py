"""The `autoopt` command line: parses flags and hands them to the module that does the work.

Each command imports its implementation lazily, so `autoopt --help` stays fast and a command's
dependencies (uvicorn, optuna, triton) load only when it runs. The serving commands live in
`cli_serve.py` and the optimize/review commands in `cli_optimize.py`; each has a `register(app)`
called here at the point that keeps `autoopt --help` in its order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import typer
from rich.console import Console

from . import __version__, cli_optimize, cli_serve

app = typer.Typer(
    help="Agents write, verify and tune fused GPU kernels for Beam-1.0, and serve it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)
console = Console()


def _version(value: bool) -> None:
    if value:
        console.print(f"autoopt {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    """autoopt: profile, optimize, verify, review and serve."""


# ---- model (issue 2) ---------------------------------------------------------------------------
@dataclass(frozen=True)
class DemoCheckpointArgs:
    path: Path
    preset: str
    seed: int


@app.command("demo-checkpoint")
def demo_checkpoint(
    path: Path = typer.Argument(..., help="Directory to write the checkpoint into."),
    preset: str = typer.Option("tiny", help="Model preset (tiny, beam-1.0-501b)."),
    seed: int = typer.Option(0, help="Seed of the random weights."),
) -> None:
    """Write a random-weight Beam checkpoint in the Hugging Face layout, with a tokenizer."""
    args = DemoCheckpointArgs(path, preset, seed)
    from model.demo import write_demo_checkpoint

    out = write_demo_checkpoint(args.path, args.preset, args.seed)
    console.print(f"wrote a random-weight [bold]{args.preset}[/] Beam checkpoint to {out}")


@dataclass(frozen=True)
class ForwardArgs:
    model: Path
    prompt: str
    dtype: str
    device: str
    top: int


@app.command()
def forward(
    model: Path = typer.Option(..., "--model", help="Checkpoint directory (HF layout)."),
    prompt: str = typer.Option("Hello, Beam!", help="Text to run through the model."),
    dtype: str = typer.Option("bfloat16", help="bfloat16 or float32."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    top: int = typer.Option(5, help="How many next-token candidates to show."),
) -> None:
    """Run one full forward pass and show the most likely next tokens."""
    from .commands import run_forward

    run_forward(ForwardArgs(model, prompt, dtype, device, top), console)


# ---- targets & profiler (issue 5) ----------------------------------------------------------------
@dataclass(frozen=True)
class TargetsArgs:
    name: str | None
    batch: int | None


@app.command()
def targets(
    name: str = typer.Argument(None, help="Show one target's per-rank op shapes."),
    batch: int = typer.Option(None, help="Batch for the shapes (default: the target's first)."),
) -> None:
    """List the optimization targets (tasks/*.toml), or show one target's op shapes."""
    from .profiler.report import targets_command

    targets_command(TargetsArgs(name, batch), console)


@dataclass(frozen=True)
class ProfileArgs:
    target: str | None
    batch: int | None
    layers: int | None
    context: int | None
    kernels: str | None
    out: Path | None
    proxy: bool
    backend: str | None
    compare: tuple[Path, Path] | None


@app.command()
def profile(
    target: str = typer.Option(None, "--target", help="Target name or TOML path."),
    batch: int = typer.Option(None, help="Sequences in the step (default: the target's first)."),
    layers: int = typer.Option(None, help="Layers to build (default: the target's, or what fits)."),
    context: int = typer.Option(None, help="Keys per sequence (decode) or prompt tokens."),
    kernels: str = typer.Option(None, help="reference (default), tuned, or a lock file path."),
    out: Path = typer.Option(None, help="Output directory (default runs/<time>-profile-<target>)."),
    proxy: bool = typer.Option(False, help="Run a GPU target on another GPU at its shapes."),
    backend: str = typer.Option(None, help="auto (default: ncu if present), ncu or torch."),
    compare: tuple[Path, Path] = typer.Option(None, help="Two profile.json files side by side."),
) -> None:
    """Profile one step of a target: time, kernels, bytes and floor per op."""
    from .profiler.report import profile_command

    args = ProfileArgs(target, batch, layers, context, kernels, out, proxy, backend, compare)
    raise typer.Exit(profile_command(args, console))


@dataclass(frozen=True)
class CeilingsArgs:
    device: str


@app.command()
def ceilings(
    device: str = typer.Option("cuda", help="The GPU to measure (cached per GPU name)."),
) -> None:
    """Measure the local GPU's copy bandwidth and BF16/FP32 matmul rates (cached per GPU)."""
    from .profiler.report import ceilings_command

    raise typer.Exit(ceilings_command(CeilingsArgs(device), console))


# ---- serving (issues 3, 3b): generate, serve live in cli_serve.py --------------------------
cli_serve.register(app)


# ---- registry & eval (issue 4) -------------------------------------------------------------------
@app.command()
def verify(
    op: str = typer.Option(..., "--op", help="Op name (registry key), e.g. swiglu."),
    variant: str = typer.Option(None, "--variant", help="Variant NAME: file DIR/OP/NAME.py."),
    source: Path = typer.Option(None, "--source", help="A variant file outside any registry."),
    registry: Path = typer.Option(None, "--registry", help="Registry DIR (default: kernels/)."),
    device: str = typer.Option("auto", help="cpu, cuda or auto (cuda when present)."),
    seeds: str = typer.Option("0,1,2", help="How many seeds per bucket shape, given as a list "
                                            "whose length counts (the seeds are secret)."),
    tokens: str = typer.Option(None, help="Bucket token counts (default: the target's)."),
    target: str = typer.Option(None, "--target", help="Target whose widths and buckets to "
                                                      "verify at (default: cpu-tiny on CPU, "
                                                      "the local GPU's targets on cuda)."),
    secret: str = typer.Option(None, "--secret", help="Reproduce a run: the secret its "
                                                      "report states."),
    timeout: float = typer.Option(300.0, help="Seconds before the candidate's worker is "
                                              "killed."),
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Verify a kernel variant against its op's reference (exit 0 verified, 1 rejected)."""
    from .eval.commands import VerifyArgs, verify_command

    args = VerifyArgs(op, variant, source, registry, device, seeds, tokens, timeout, json_out,
                      target, secret)
    try:
        code = verify_command(args, console)
    except (ValueError, FileNotFoundError) as exc:
        Console(stderr=True).print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    raise typer.Exit(code)


@app.command()
def bench(
    op: str = typer.Option(..., "--op", help="Op name (registry key), e.g. swiglu."),
    variant: str = typer.Option(None, "--variant", help="Variant NAME (default: reference only)."),
    source: Path = typer.Option(None, "--source", help="A variant file outside any registry."),
    registry: Path = typer.Option(None, "--registry", help="Registry DIR (default: kernels/)."),
    target: str = typer.Option(None, "--target", help="Target whose shapes to time."),
    tokens: str = typer.Option(None, help="Token counts, e.g. 1,8,32 (default: the op's)."),
    device: str = typer.Option("auto", help="cpu, cuda or auto (cuda when present)."),
    warmup: int = typer.Option(10, help="Warm-up calls before timing."),
    iters: int = typer.Option(50, help="Timed samples (graph replays on cuda)."),
    compile_: bool = typer.Option(True, "--compile/--no-compile",
                                  help="Also time torch.compile of the reference."),
    json_out: bool = typer.Option(False, "--json", help="Print the rows as JSON."),
) -> None:
    """Time reference, torch.compile and a variant: median, IQR, ratios, % of floor."""
    from .eval.commands import BenchArgs, bench_command

    args = BenchArgs(op, variant, source, registry, target, tokens, device, warmup, iters,
                     compile_, json_out)
    try:
        code = bench_command(args, console)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        Console(stderr=True).print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    raise typer.Exit(code)


# ---- registry (issue 4b) ------------------------------------------------------------------------
registry_app = typer.Typer(help="The kernel registry: variants, records, tuned configs, the lock.",
                           no_args_is_help=True)
app.add_typer(registry_app, name="registry")
_REGISTRY_DIR = typer.Option(None, "--registry",
                             help="Registry directory (default: $AUTOOPT_REGISTRY or kernels/).")


def _registry(command: str, **fields) -> None:
    from .registry_cmd import RegistryArgs, run_registry

    code = run_registry(command, RegistryArgs(**fields), console)
    if code:
        raise typer.Exit(code)


@registry_app.command("list")
def registry_list(
    registry: Path = _REGISTRY_DIR,
    op: str = typer.Option(None, "--op", help="Only this op."),
) -> None:
    """Every variant: status, file check (exit 1 if a recorded file changed), lock, speed-up."""
    _registry("list", root=registry, op=op)


@registry_app.command("show")
def registry_show(
    op: str = typer.Argument(..., help="Op name, e.g. rmsnorm."),
    variant: str = typer.Argument(..., help="Variant name, e.g. triton_v1."),
    registry: Path = _REGISTRY_DIR,
    as_json: bool = typer.Option(False, "--json", help="Print the record as JSON."),
) -> None:
    """One variant's record: provenance, verification, benchmarks, tuned configs."""
    _registry("show", root=registry, op=op, variant=variant, as_json=as_json)


@registry_app.command("diff")
def registry_diff(
    op: str = typer.Argument(..., help="Op name."),
    a: str = typer.Argument(..., help="First variant."),
    b: str = typer.Argument(..., help="Second variant."),
    registry: Path = _REGISTRY_DIR,
) -> None:
    """Source diff of two variants of one op, with their evidence side by side."""
    _registry("diff", root=registry, op=op, variant=a, other=b)


@registry_app.command("lock")
def registry_lock(
    registry: Path = _REGISTRY_DIR,
    arch: str = typer.Option(None, help="Arch section, e.g. sm_90 (default: this machine's)."),
    op: str = typer.Option(None, "--op", help="Op to select a variant for."),
    variant: str = typer.Option(None, "--variant", help="Accepted variant to lock for --op."),
    unset: bool = typer.Option(False, "--unset", help="Remove --op from the arch section."),
    lock_file: Path = typer.Option(None, "--file", help="Lock file (default: the registry's)."),
) -> None:
    """Show the lock (exit 1 if an entry is not an accepted, unmodified variant), or edit it."""
    _registry("lock", root=registry, arch=arch, op=op, variant=variant, unset=unset,
              lock_file=lock_file)


@registry_app.command("set-status")
def registry_set_status(
    op: str = typer.Argument(..., help="Op name."),
    variant: str = typer.Argument(..., help="Variant name."),
    status: str = typer.Argument(..., help="candidate, accepted or rejected."),
    reason: str = typer.Option("", help="Why (kept in the record)."),
    registry: Path = _REGISTRY_DIR,
) -> None:
    """Set a recorded variant's status (only accepted variants can be locked)."""
    _registry("set-status", root=registry, op=op, variant=variant, status=status, reason=reason)


# ---- optimize & review (issue 6): optimize, the review sub-app live in cli_optimize.py ------
cli_optimize.register(app)


if __name__ == "__main__":  # `python -m autoopt.cli`, e.g. under torchrun (issue 7)
    app()
