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


# ---- serving (issue 3) -------------------------------------------------------------------------
@dataclass(frozen=True)
class GenerateArgs:
    model: Path | None
    prompt: str | None
    prompt_ids: str | None
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    device: str | None
    dtype: str | None
    kernels: str | None
    max_model_len: int | None
    cuda_graphs: bool | None
    json: bool
    tp: int | None = None  # issue 7
    ep: int | None = None


@app.command()
def generate(
    model: Path = typer.Option(None, "--model", help="Checkpoint directory (default: the demo)."),
    prompt: str = typer.Option(None, "--prompt", help="Prompt text (tokenized, no template)."),
    prompt_ids: str = typer.Option(None, "--prompt-ids", help="Prompt token ids: 1,2,3."),
    max_tokens: int = typer.Option(16, "--max-tokens", help="Tokens to generate at most."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus mass (1 = off)."),
    top_k: int = typer.Option(0, "--top-k", help="Top-k (0 = off)."),
    seed: int = typer.Option(None, help="Sampling seed (reproducible per request)."),
    device: str = typer.Option(None, help="cpu, cuda or auto (default: the engine's, auto)."),
    dtype: str = typer.Option(None, help="bfloat16 or float32 (default: the engine's)."),
    kernels: str = typer.Option(None, help="reference, tuned or a lock file (default: tuned)."),
    max_model_len: int = typer.Option(None, "--max-model-len", help="Context limit."),
    cuda_graphs: bool = typer.Option(None, "--cuda-graphs/--no-cuda-graphs",
                                     help="Capture decode in CUDA graphs (GPU; default on)."),
    json_out: bool = typer.Option(False, "--json", help="Print {token_ids, text} last, as JSON."),
    tp: int = typer.Option(None, "--tp", help="Tensor-parallel ranks: one process per GPU "
                           "(NCCL), or N CPU processes (gloo)."),
    ep: int = typer.Option(None, "--ep", help="Expert parallelism: 1 (default) or the --tp value."),
) -> None:
    """Generate from one prompt offline, through the serving engine."""
    args = GenerateArgs(model, prompt, prompt_ids, max_tokens, temperature, top_p, top_k, seed,
                        device, dtype, kernels, max_model_len, cuda_graphs, json_out, tp, ep)
    import json
    from dataclasses import asdict

    from model.serve.offline import GenerateRequest, run_generate
    from model.serve.sampler import RequestError

    fields = {k: v for k, v in asdict(args).items() if k != "json"}
    from model.parallel import TPError

    try:
        result, engine = run_generate(GenerateRequest(**fields))
    except (RequestError, ValueError) as exc:
        Console(stderr=True).print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    except TPError as exc:  # a rank died or failed (issue 7)
        Console(stderr=True).print("error: " + str(exc), markup=False, highlight=False,
                                         soft_wrap=True)
        raise typer.Exit(1) from None
    if result is None:
        return  # a torchrun rank other than 0: rank 0 prints
    err = Console(stderr=True)
    err.print(engine.startup_report)
    err.print(f"{len(result.prompt_token_ids)} prompt tokens, {len(result.token_ids)} generated, "
              f"finish_reason={result.finish_reason}")
    if args.json:
        print(json.dumps({"token_ids": result.token_ids, "text": result.text}))
    else:
        print(result.text if engine.tokenizer is not None else result.token_ids)


# ---- serve (issue 3b) --------------------------------------------------------------------------
@app.command()
def serve(
    model: Path = typer.Option(None, "--model", help="Checkpoint directory (default: the demo)."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8000, help="Port to listen on."),
    device: str = typer.Option(None, help="cpu, cuda or auto (default: the engine's, auto)."),
    dtype: str = typer.Option(None, help="bfloat16 or float32 (default: the engine's)."),
    kernels: str = typer.Option(None, help="reference, tuned or a lock file (default: tuned)."),
    max_num_seqs: int = typer.Option(None, "--max-num-seqs", help="Running requests at most."),
    max_model_len: int = typer.Option(None, "--max-model-len", help="Context limit in tokens."),
    max_num_batched_tokens: int = typer.Option(None, "--max-num-batched-tokens",
                                               help="Tokens per step (chunked prefill)."),
    gpu_memory_utilization: float = typer.Option(None, "--gpu-memory-utilization",
                                                 help="Fraction of GPU memory to use."),
    api_key: str = typer.Option(None, "--api-key", help="Require this bearer / x-api-key."),
    served_model_name: str = typer.Option(None, "--served-model-name",
                                          help="Model name in the API (default: the dir name)."),
    tp: int = typer.Option(None, "--tp", help="Tensor-parallel ranks: one process per GPU "
                           "(NCCL), or N CPU processes (gloo)."),
    ep: int = typer.Option(None, "--ep", help="Expert parallelism: 1 (default) or the --tp value."),
) -> None:
    """Serve a checkpoint over the OpenAI and Anthropic HTTP APIs (no --model: the demo)."""
    from model.parallel import TPError
    from model.serve.api import ServeOptions, run_server

    opts = ServeOptions(model, host, port, device, dtype, kernels, max_num_seqs, max_model_len,
                        max_num_batched_tokens, gpu_memory_utilization, api_key, served_model_name,
                        tp, ep)
    try:
        run_server(opts, say=lambda line: console.print(line, highlight=False, markup=False,
                                                        soft_wrap=True))
    except (ValueError, FileNotFoundError) as exc:
        Console(stderr=True).print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    except TPError as exc:  # a rank died or failed: the group is down (issue 7)
        Console(stderr=True).print("error: " + str(exc), markup=False, highlight=False,
                                         soft_wrap=True)
        raise typer.Exit(1) from None


# ---- registry & eval (issue 4) -------------------------------------------------------------------
@app.command()
def verify(
    op: str = typer.Option(..., "--op", help="Op name (registry key), e.g. swiglu."),
    variant: str = typer.Option(None, "--variant", help="Variant NAME: file DIR/OP/NAME.py."),
    source: Path = typer.Option(None, "--source", help="A variant file outside any registry."),
    registry: Path = typer.Option(None, "--registry", help="Registry DIR (default: kernels/)."),
    device: str = typer.Option("auto", help="cpu, cuda or auto (cuda when present)."),
    seeds: str = typer.Option("0,1,2", help="Input seeds, comma-separated."),
    tokens: str = typer.Option(None, help="Token counts of the shapes (default: the op's)."),
    timeout: float = typer.Option(300.0, help="Seconds before the candidate's child is killed."),
    json_out: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Verify a kernel variant against its op's reference (exit 0 verified, 1 rejected)."""
    from .eval.commands import VerifyArgs, verify_command

    args = VerifyArgs(op, variant, source, registry, device, seeds, tokens, timeout, json_out)
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


# ---- optimize & review (issue 6) ----------------------------------------------------------------
def _fail(exc: BaseException, code: int = 2) -> typer.Exit:
    Console(stderr=True).print(f"[red]error:[/] {exc}")
    return typer.Exit(code)


@app.command()
def optimize(
    target: str = typer.Option(None, "--target", help="Target (default: this GPU's decode "
                               "target, or cpu-tiny without a GPU)."),
    agent: str = typer.Option(None, "--agent", help="template or claude (default: claude when "
                              "ANTHROPIC_API_KEY is set, else template)."),
    ops: str = typer.Option(None, "--ops", help="Only these ops, comma-separated."),
    budget: str = typer.Option("30m", help="Wall-time budget for the agent sessions (30m, 90s)."),
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
    e2e: bool = typer.Option(True, "--e2e/--no-e2e", help="End-to-end check of the new set."),
    profile_backend: str = typer.Option("auto", help="Profiler: auto, ncu or torch."),
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


review_app = typer.Typer(help="Read agent-produced variants with their evidence; accept or "
                         "reject them.", no_args_is_help=True)
app.add_typer(review_app, name="review")
_REVIEW_REGISTRY = typer.Option(None, "--registry", help="Registry DIR (default: kernels/).")


def _review_registry(registry: Path | None):
    from model.registry import Registry

    from . import env

    return Registry(registry or env.registry_dir())


@review_app.command("list")
def review_list(
    registry: Path = _REVIEW_REGISTRY,
    status: str = typer.Option("candidate", help="candidate (pending), accepted or rejected."),
) -> None:
    """Pending candidates: op, variant, agent, speedup, verdict."""
    from .review import print_list

    print_list(_review_registry(registry), console, status)


@review_app.command("show")
def review_show(
    op: str = typer.Argument(..., help="Op name."),
    variant: str = typer.Argument(..., help="Variant name."),
    registry: Path = _REVIEW_REGISTRY,
    arch: str = typer.Option(None, help="Diff against the variant locked for this arch."),
) -> None:
    """Source, diff against the selection (or reference), verification, timings, profile."""
    from model.registry import RegistryError

    from .review import print_show

    try:
        print_show(_review_registry(registry), console, op, variant, arch)
    except RegistryError as exc:
        raise _fail(exc) from None


@review_app.command("accept")
def review_accept(
    op: str = typer.Argument(..., help="Op name."),
    variant: str = typer.Argument(..., help="Variant name."),
    arch: str = typer.Option(None, help="Lock section, e.g. sm_90 (default: the record's)."),
    registry: Path = _REVIEW_REGISTRY,
) -> None:
    """Accept a variant: status accepted and selected in the lock for the arch."""
    from model.registry import RegistryError

    from .review import accept

    try:
        console.print(accept(_review_registry(registry), op, variant, arch))
    except RegistryError as exc:
        raise _fail(exc) from None


@review_app.command("reject")
def review_reject(
    op: str = typer.Argument(..., help="Op name."),
    variant: str = typer.Argument(..., help="Variant name."),
    why: str = typer.Option(..., "--why", help="What is wrong with it (kept in the record)."),
    registry: Path = _REVIEW_REGISTRY,
) -> None:
    """Reject a variant with a reason (recorded; removed from the lock if locked)."""
    from model.registry import RegistryError

    from .review import reject

    try:
        console.print(reject(_review_registry(registry), op, variant, why))
    except RegistryError as exc:
        raise _fail(exc) from None


if __name__ == "__main__":  # `python -m autoopt.cli`, e.g. under torchrun (issue 7)
    app()
