"""`autoopt generate` and `autoopt serve`: the serving commands' flags (issue 3).

Registered on the app by `autoopt/cli.py` through `register`, which keeps the `--help` order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import typer

from .console import make_console

console = make_console()


def register(app: typer.Typer) -> None:
    """Add `generate` and `serve` to `app`, in that order."""
    app.command()(generate)
    app.command()(serve)


# ---- serving (issue 3) -------------------------------------------------------------------------
ATTENTION_HELP = ("which variant of the registry's attention op serves: auto (the lock's, "
                  "default), torch (the reference), triton, flashinfer (GPU), or a variant name.")
REGISTRY_HELP = ("Registry DIR the kernels and their lock come from (default: $AUTOOPT_REGISTRY, "
                 "the checkout's kernels/, or your per-user registry, else the shipped one).")


def registry_root(registry: Path | None) -> str:
    """The registry the runtime reads (defined in autoopt/env.py), as a path for the engine."""
    from . import env

    return str(env.open_registry(registry).root)

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
    attention_backend: str | None = None
    registry: str | None = None


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
    attention_backend: str = typer.Option(None, "--attention-backend", help=ATTENTION_HELP),
    registry: Path = typer.Option(None, "--registry", help=REGISTRY_HELP),
) -> None:
    """Generate from one prompt offline, through the serving engine."""
    args = GenerateArgs(model, prompt, prompt_ids, max_tokens, temperature, top_p, top_k, seed,
                        device, dtype, kernels, max_model_len, cuda_graphs, json_out, tp, ep,
                        attention_backend, registry_root(registry))
    import json
    from dataclasses import asdict

    from model.serve.offline import GenerateRequest, run_generate
    from model.serve.sampler import RequestError

    fields = {k: v for k, v in asdict(args).items() if k != "json"}
    from model.parallel import TPError

    try:
        result, engine = run_generate(GenerateRequest(**fields))
    except (RequestError, ValueError) as exc:
        make_console(stderr=True).print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    except TPError as exc:  # a rank died or failed (issue 7)
        make_console(stderr=True).print("error: " + str(exc), markup=False, highlight=False,
                                         soft_wrap=True)
        raise typer.Exit(1) from None
    if result is None:
        return  # a torchrun rank other than 0: rank 0 prints
    err = make_console(stderr=True)
    err.print(engine.startup_report)
    err.print(f"{len(result.prompt_token_ids)} prompt tokens, {len(result.token_ids)} generated, "
              f"finish_reason={result.finish_reason}")
    if args.json:
        print(json.dumps({"token_ids": result.token_ids, "text": result.text}))
    else:
        print(result.text if engine.tokenizer is not None else result.token_ids)


# ---- serve (issue 3b) --------------------------------------------------------------------------
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
    attention_backend: str = typer.Option(None, "--attention-backend", help=ATTENTION_HELP),
    registry: Path = typer.Option(None, "--registry", help=REGISTRY_HELP),
) -> None:
    """Serve a checkpoint over the OpenAI and Anthropic HTTP APIs (no --model: the demo)."""
    from model.parallel import TPError
    from model.serve.api import ServeOptions, run_server

    opts = ServeOptions(model, host, port, device, dtype, kernels, max_num_seqs, max_model_len,
                        max_num_batched_tokens, gpu_memory_utilization, api_key, served_model_name,
                        tp, ep, attention_backend, registry_root(registry))
    try:
        run_server(opts, say=lambda line: console.print(line, highlight=False, markup=False,
                                                        soft_wrap=True))
    except (ValueError, FileNotFoundError) as exc:
        make_console(stderr=True).print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    except TPError as exc:  # a rank died or failed: the group is down (issue 7)
        make_console(stderr=True).print("error: " + str(exc), markup=False, highlight=False,
                                         soft_wrap=True)
        raise typer.Exit(1) from None
