"""`autoopt generate` and `autoopt serve`: the serving commands' flags.

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


# ---- generate ----------------------------------------------------------------------------------
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
    tp: int | None = None
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
    kernels: str = typer.Option(None, help="reference, tuned or a lock file (default: tuned); "
                                "a +compile suffix (tuned+compile) runs the ops the lock leaves "
                                "at the reference under torch.compile."),
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

    from autoopt.env import demo_checkpoint_dir
    from model.parallel import TPError
    from model.serve.engine.offline import GenerateRequest, run_generate
    from model.serve.engine.sampler import RequestError

    fields = {k: v for k, v in asdict(args).items() if k != "json"}
    try:
        result, engine = run_generate(GenerateRequest(**fields,
                                                      demo_checkpoint=demo_checkpoint_dir()))
    except (RequestError, ValueError) as exc:
        make_console(stderr=True).print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    except TPError as exc:  # a rank died or failed
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


# ---- serve -------------------------------------------------------------------------------------
def serve(
    model: Path = typer.Option(None, "--model", help="Checkpoint directory (default: the demo)."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8000, help="Port to listen on."),
    device: str = typer.Option(None, help="cpu, cuda or auto (default: the engine's, auto)."),
    dtype: str = typer.Option(None, help="bfloat16 or float32 (default: the engine's)."),
    kernels: str = typer.Option(None, help="reference, tuned or a lock file (default: tuned); "
                                "a +compile suffix (tuned+compile) runs the ops the lock leaves "
                                "at the reference under torch.compile."),
    max_num_seqs: int = typer.Option(None, "--max-num-seqs", help="Running requests at most."),
    max_model_len: int = typer.Option(None, "--max-model-len", help="Context limit in tokens."),
    max_num_batched_tokens: int = typer.Option(None, "--max-num-batched-tokens",
                                               help="Tokens per step (chunked prefill)."),
    gpu_memory_utilization: float = typer.Option(None, "--gpu-memory-utilization",
                                                 help="Fraction of GPU memory to use."),
    api_key: str = typer.Option(None, "--api-key", help="Require this bearer / x-api-key "
                                "(default: $AUTOOPT_API_KEY; none: no key)."),
    allowed_origins: list[str] = typer.Option(
        None, "--allowed-origins", help="Web origins allowed to call the server, e.g. "
        "http://localhost:3000 (repeat or comma-separate; '*': any). Default: none, so requests "
        "from web pages are refused."),
    max_request_bytes: int = typer.Option(None, "--max-request-bytes", help="Largest request "
                                          "body in bytes, 413 above (default: 16 MiB)."),
    body_timeout: float = typer.Option(None, "--body-timeout", help="Seconds a request body "
                                       "may take to arrive, 408 after (default: 30)."),
    header_timeout: float = typer.Option(None, "--header-timeout", help="Seconds a request's "
                                         "headers may take to arrive (default: 10)."),
    batch_invariant: bool = typer.Option(None, "--batch-invariant/--no-batch-invariant",
                                         help="Greedy tokens that do not depend on batching or "
                                         "preemption (slower: one forward per token)."),
    served_model_name: str = typer.Option(None, "--served-model-name",
                                          help="Model name in the API (default: the dir name)."),
    tp: int = typer.Option(None, "--tp", help="Tensor-parallel ranks: one process per GPU "
                           "(NCCL), or N CPU processes (gloo)."),
    ep: int = typer.Option(None, "--ep", help="Expert parallelism: 1 (default) or the --tp value."),
    attention_backend: str = typer.Option(None, "--attention-backend", help=ATTENTION_HELP),
    registry: Path = typer.Option(None, "--registry", help=REGISTRY_HELP),
) -> None:
    """Serve a checkpoint over the OpenAI and Anthropic HTTP APIs (no --model: the demo)."""
    from autoopt.env import demo_checkpoint_dir, serve_api_key
    from model.parallel import TPError
    from model.serve.http.limits import HTTPLimits
    from model.serve.http.server import ServeOptions, run_server

    origins = tuple(o.strip() for given in allowed_origins or [] for o in given.split(",")
                    if o.strip())
    given = {"max_request_bytes": max_request_bytes, "body_timeout_s": body_timeout,
             "header_timeout_s": header_timeout}
    try:
        limits = HTTPLimits(**{k: v for k, v in given.items() if v is not None})
    except ValueError as exc:
        make_console(stderr=True).print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    opts = ServeOptions(model, host, port, device, dtype, kernels, max_num_seqs, max_model_len,
                        max_num_batched_tokens, gpu_memory_utilization,
                        api_key if api_key is not None else serve_api_key(), served_model_name,
                        tp, ep, attention_backend, registry_root(registry),
                        demo_checkpoint=demo_checkpoint_dir(),
                        allowed_origins=origins, limits=limits, batch_invariant=batch_invariant)
    try:
        run_server(opts, say=lambda line: console.print(line, highlight=False, markup=False,
                                                        soft_wrap=True))
    except (ValueError, FileNotFoundError) as exc:
        make_console(stderr=True).print(f"[red]error:[/] {exc}")
        raise typer.Exit(2) from None
    except TPError as exc:  # a rank died or failed: the group is down
        make_console(stderr=True).print("error: " + str(exc), markup=False, highlight=False,
                                         soft_wrap=True)
        raise typer.Exit(1) from None
