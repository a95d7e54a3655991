"""The `autoopt` command line: parses flags and hands them to the module that does the work.

Each command imports its implementation lazily, so `autoopt --help` stays fast and a command's
dependencies (uvicorn, optuna, triton) load only when it runs. The serving commands live in
`cli_serve.py`, optimize in `cli_optimize.py` and the registry/review sub-app in
`cli_registry.py`; each has a `register(app)` called here at the point that keeps
`autoopt --help` in its order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import typer

from . import __version__, cli_bench, cli_optimize, cli_registry, cli_serve
from .console import make_console

app = typer.Typer(
    help="Agents write, verify and tune fused GPU kernels for Beam-1.0, and serve it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)
console = make_console()


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


# ---- model ---------------------------------------------------------------------------------------
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


# ---- targets & profiler --------------------------------------------------------------------------
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
    from .targets import TargetError

    try:
        targets_command(TargetsArgs(name, batch), console)
    except TargetError as exc:
        make_console(stderr=True).print(f"[red]error:[/] {exc}", highlight=False)
        raise typer.Exit(2) from None


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
    eager: bool = False
    attention_backend: str = "auto"
    ncu_sample: int = 0


@app.command()
def profile(
    target: str = typer.Option(None, "--target", help="Target name or TOML path."),
    batch: int = typer.Option(None, help="Sequences in the step (default: the target's first)."),
    layers: int = typer.Option(None, help="Layers to build (default: the target's, or what fits)."),
    context: int = typer.Option(None, help="Keys per sequence (decode) or prompt tokens."),
    kernels: str = typer.Option(None, help="reference (default), tuned, or a lock file path."),
    out: Path = typer.Option(None, help="Output directory (default runs/<time>-profile-<target>)."),
    proxy: bool = typer.Option(False, help="Run a GPU target on another GPU at its shapes."),
    backend: str = typer.Option(None, help="auto or torch (torch.profiler); ncu adds a sampled "
                                "Nsight Compute pass over the top ops' kernels."),
    compare: tuple[Path, Path] = typer.Option(None, help="Two profile.json files side by side."),
    eager: bool = typer.Option(False, "--eager", help="Profile the eager step instead of the "
                               "CUDA-graph replay the server runs."),
    attention_backend: str = typer.Option("auto", "--attention-backend",
                                          help="auto, torch or flashinfer."),
    ncu_sample: int = typer.Option(0, "--ncu-sample", help="Nsight Compute on at most N "
                                   "kernels of the top ops (0: none)."),
) -> None:
    """Profile the served step of a target: time, kernels, bytes and floor per op."""
    from .profiler.report import profile_command

    args = ProfileArgs(target, batch, layers, context, kernels, out, proxy, backend, compare,
                       eager, attention_backend, ncu_sample)
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


# ---- serving: generate, serve live in cli_serve.py -----------------------------------------
cli_serve.register(app)


# ---- registry & eval -----------------------------------------------------------------------------
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
    memcheck: bool = typer.Option(False, "--memcheck", help="On a GPU, also run a Triton or "
                                  "CuTe variant under compute-sanitizer's memcheck (accesses "
                                  "out of bounds), torch's caching allocator off."),
    config: str = typer.Option(None, "--config", help="JSON config for every call, e.g. "
                               "'{\"BLOCK_N\": 64}' (default: the variant's DEFAULT_CONFIG)."),
    configs: str = typer.Option(None, "--configs", help="JSON config per token bucket, e.g. "
                                "'{\"T=1\": {...}, \"T=8\": {...}}': each call gets its "
                                "nearest bucket's, as serving picks (a verdict's `configs`)."),
) -> None:
    """Verify a kernel variant against its op's reference (exit 0 verified, 1 rejected)."""
    from .eval.commands import VerifyArgs, verify_command

    args = VerifyArgs(op, variant, source, registry, device, seeds, tokens, timeout, json_out,
                      target, secret, memcheck, config, configs)
    try:
        code = verify_command(args, console)
    except (ValueError, FileNotFoundError) as exc:
        make_console(stderr=True).print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    raise typer.Exit(code)


# `bench op` / `bench model` (and `bench --op X`) live in cli_bench.py
cli_bench.register(app)


# ---- optimize (cli_optimize.py), the registry and its `review` alias (cli_registry.py) ----------
cli_optimize.register(app)
cli_registry.register(app)


if __name__ == "__main__":  # `python -m autoopt.cli`, e.g. under torchrun
    app()
