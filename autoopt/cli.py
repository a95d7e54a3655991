"""The `autoopt` command line: parses flags and hands them to the module that does the work.

Each command imports its implementation lazily, so `autoopt --help` stays fast and a command's
dependencies (uvicorn, optuna, triton) load only when it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import typer
from rich.console import Console

from . import __version__

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
