"""Offline generation for `autoopt generate`: one prompt through the same engine the server uses."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from .llm_engine import EngineConfig, LLMEngine
from .outputs import CompletionResult
from .sampler import RequestError, SamplingParams


def parse_prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise RequestError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise RequestError("--prompt-ids is empty; give at least one token id")
    return ids


@dataclass(frozen=True)
class GenerateRequest:
    """What `autoopt generate` asks for; None fields take the EngineConfig default."""

    model: Path | None
    prompt: str | None
    prompt_ids: str | None
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    device: str | None = None
    dtype: str | None = None
    kernels: str | None = None
    max_model_len: int | None = None
    cuda_graphs: bool | None = None
    tp: int | None = None
    ep: int | None = None
    attention_backend: str | None = None
    registry: str | None = None
    demo_checkpoint: Path | None = None  # where the demo is written when `model` is None


def run_generate(req: GenerateRequest) -> tuple[CompletionResult | None, LLMEngine | None]:
    """The completion and the engine (at tp > 1 a summary with its startup report and
    tokenizer); (None, None) on a torchrun rank other than 0, which prints nothing."""
    if (req.prompt is None) == (req.prompt_ids is None):
        raise RequestError("give exactly one of --prompt TEXT or --prompt-ids 1,2,3")
    model = req.model
    if model is None:
        if req.demo_checkpoint is None:
            raise RequestError("no --model given and no demo checkpoint directory; pass --model")
        from ...demo import ensure_demo_checkpoint

        model = ensure_demo_checkpoint(req.demo_checkpoint)
    names = {f.name for f in fields(EngineConfig)}
    given = {k: getattr(req, k) for k in ("device", "dtype", "kernels", "max_model_len",
                                          "cuda_graphs", "tp", "ep", "attention_backend",
                                          "registry")
             if getattr(req, k) is not None}
    config = EngineConfig(model=str(model), **{k: v for k, v in given.items() if k in names},
                          max_num_seqs=1)
    if config.tp > 1:
        from .tp_worker import run_generate_tp

        return run_generate_tp(config, req)
    engine = LLMEngine(config)
    ids = prompt_token_ids(req, engine.tokenizer)
    return engine.generate([ids], sampling_params(req))[0], engine


def prompt_token_ids(req: GenerateRequest, tokenizer) -> list[int]:
    if req.prompt is None:
        return parse_prompt_ids(req.prompt_ids)
    if tokenizer is None:
        raise RequestError(f"{req.model or 'the checkpoint'} has no tokenizer.json; pass "
                           "--prompt-ids instead")
    ids = tokenizer.encode(req.prompt)
    if not ids:
        raise RequestError("the prompt encodes to no tokens")
    return ids


def sampling_params(req: GenerateRequest) -> SamplingParams:
    return SamplingParams(max_tokens=req.max_tokens, temperature=req.temperature,
                          top_p=req.top_p, top_k=req.top_k, seed=req.seed)
