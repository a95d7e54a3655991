"""Tensor-parallel serving: `autoopt serve --tp N` and `autoopt generate --tp N`.

Every rank holds its shard of the model and its own KV cache (its KV heads, the same page ids)
and runs the same model step; rank 0 alone owns the scheduler, the sampler and the HTTP API:

    rank 0:  schedule -> broadcast the step plan -> runner.execute -> sample
    rank r:  receive the step plan -> replay the page operations -> runner.execute (no sampling)

A plan carries the step's chunks (sequence id, first position, token ids, whether it samples)
and the page-table operations (allocate / trim / free) that rank 0's cache performed since the
previous plan. PagedKVCache is deterministic, so replaying them gives every rank the same page
tables without sending any table. Every rank then builds the identical flat batch and runs the
identical forward, so the collectives inside it (rank sums, the vocab gather) pair up, and the
deterministic rank sums keep hidden states and the router's expert choice equal on all ranks.

Plans travel over a gloo group of their own (CPU objects even when the model's group is NCCL)
with a timeout an idle server never reaches: workers wait for the next plan as long as it takes.
The ranks are processes of `model.parallel.launch`: spawned here (one per GPU with NCCL, N CPU
processes with gloo), or started by torchrun, each process then being one rank:

    torchrun --nproc-per-node 2 -m autoopt.cli generate --tp 2 --model CKPT --prompt-ids 1,2,3
    torchrun --nproc-per-node 2 -m autoopt.cli serve --tp 2 --model CKPT --port 8000

A rank that dies brings the group down: `launch` stops the other ranks and raises TPError naming
the dead one (under torchrun, its agent stops them). CUDA graphs are off under TP: capturing the
collectives is not verified on the GPU yet.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ...config import BeamConfig
from ...parallel import TPError, TPGroup, _under_torchrun, attach, launch
from .kv_cache import PagedKVCache
from .llm_engine import EngineConfig, LLMEngine, load_tokenizer
from .outputs import CompletionResult
from .sampler import SamplingParams

# Plans wait on this group while the server is idle; a dead peer still fails it at once (its
# socket closes), and `launch` watches the processes themselves.
CONTROL_TIMEOUT = timedelta(days=365)
_PAGE_OPS = ("allocate", "trim", "free")  # every PagedKVCache method that changes page tables


# ---- the step plan --------------------------------------------------------------------------
@dataclass(frozen=True)
class PlannedChunk:
    """What a worker's runner needs of a scheduled chunk (runner.StepChunk)."""

    seq_id: int
    start: int
    num_tokens: int
    token_ids: list[int]
    sample: bool


@dataclass(frozen=True)
class StepPlan:
    page_ops: list[tuple]  # (method name, *args) on PagedKVCache, in rank 0's order
    chunks: list[PlannedChunk]
    stop: bool = False  # the last plan: replay its page operations, then return


class PageLog:
    """Records rank 0's page-table operations, for the workers to replay in the same order."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.ops: list[tuple] = []
        for name in _PAGE_OPS:
            setattr(cache, name, self._recording(name, getattr(cache, name)))

    def _recording(self, name: str, method):
        def call(*args):
            method(*args)  # raises before changing anything when the pages do not fit
            self.ops.append((name, *args))

        return call

    def drain(self) -> list[tuple]:
        ops, self.ops = self.ops, []
        return ops


class PlanBroadcaster:
    """Rank 0's runner: sends each step's plan to the workers, then runs the step as they do."""

    def __init__(self, runner, log: PageLog, control: TPGroup) -> None:
        self.runner, self.log, self.control = runner, log, control

    def execute(self, chunks) -> torch.Tensor:
        planned = [PlannedChunk(c.seq_id, c.start, c.num_tokens, list(c.token_ids), c.sample)
                   for c in chunks]
        self.control.broadcast_object(StepPlan(self.log.drain(), planned))
        return self.runner.execute(chunks)

    def stop_workers(self) -> None:
        self.control.broadcast_object(StepPlan(self.log.drain(), [], stop=True))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)


def follow_steps(engine: LLMEngine, control: TPGroup) -> None:
    """A worker rank: run rank 0's steps on this rank's shard until rank 0 says stop."""
    while True:
        plan = control.broadcast_object(None)
        for name, *args in plan.page_ops:
            getattr(engine.cache, name)(*args)
        if plan.stop:
            return
        engine.runner.execute(plan.chunks)  # the logits are rank 0's to sample


# ---- one rank -------------------------------------------------------------------------------
class RankEngine(LLMEngine):
    """One rank's engine: its shard and KV cache; the KV budget is the smallest rank's, so every
    rank holds the same pages. A failing step is fatal here: re-running part of it on rank 0
    alone would leave the other ranks waiting in its collectives (engine/faults.py)."""

    isolate_step_failures = False

    def __init__(self, config: EngineConfig, model, control: TPGroup) -> None:
        self.control = control
        super().__init__(config, model=model)

    def _kv_budget(self) -> int:
        mine = torch.tensor([super()._kv_budget()], dtype=torch.int64)
        return int(self.control.gather_partials(mine).min())


def control_group(group: TPGroup) -> TPGroup:
    """A gloo group over the same ranks for step plans (see CONTROL_TIMEOUT)."""
    cpu = torch.device("cpu")
    if group.size == 1:
        return TPGroup(0, 1, "gloo", cpu)
    pg = dist.new_group(list(range(group.size)), timeout=CONTROL_TIMEOUT, backend="gloo")
    return TPGroup(group.rank, group.size, "gloo", cpu, pg)


def start_rank(config: EngineConfig, group: TPGroup) -> tuple[RankEngine, TPGroup]:
    """Load this rank's shard, attach it to the group and build its engine; on rank 0 the
    runner also broadcasts every step's plan."""
    from ...weights import load_model

    print(f"tp rank {group.rank}/{group.size}: pid {os.getpid()} on {group.device}",
          file=sys.stderr, flush=True)
    control = control_group(group)
    model = load_model(config.model, dtype=config.torch_dtype, device=str(group.device),
                       tp=group.size, rank=group.rank, ep=config.ep,
                       kernels=config.kernels or "tuned", registry=config.registry)
    attach(model, group)
    engine = RankEngine(replace(config, cuda_graphs=False, kernels=None), model, control)
    pages = {name: pool.num_pages for name, pool in engine.cache.pools.items()}
    first = control.broadcast_object(pages)
    if first != pages:
        raise TPError(f"rank {group.rank}: its KV cache has {pages} pages but rank 0's has "
                      f"{first}; every rank must hold the same pages (same config and dtype)")
    if group.rank == 0:
        engine.runner = PlanBroadcaster(engine.runner, PageLog(engine.cache), control)
        graphs_off = config.cuda_graphs and group.device.type == "cuda"
        engine.startup_report += (f"; tensor parallel over {group.size} ranks ({group.backend}"
                                  f"{', CUDA graphs off' if graphs_off else ''}), each with "
                                  "this KV cache for its own KV heads")
    return engine, control


def backend_for(config: EngineConfig) -> str:
    return "nccl" if config.resolved_device().type == "cuda" else "gloo"


def check_layout(config: EngineConfig) -> None:
    """Refuse, before any process starts, a layout the model or the machine cannot run."""
    if config.model is None:
        raise ValueError("EngineConfig.model is None: tensor-parallel ranks load the model "
                         "from a checkpoint directory")
    BeamConfig.load(config.model).shard(config.tp, config.ep)  # ValueError says what divides
    device = config.resolved_device()
    if device.type == "cuda" and device.index is not None and config.tp > 1:
        raise ValueError(f"device {config.device!r} names one GPU, but rank r of a "
                         "tensor-parallel group uses GPU r; pass --device cuda")
    if device.type == "cuda" and not _under_torchrun() and torch.cuda.device_count() < config.tp:
        raise ValueError(f"--tp {config.tp} with NCCL needs {config.tp} GPUs, but "
                         f"{torch.cuda.device_count()} are visible; lower --tp or use "
                         "--device cpu (gloo)")


# ---- offline generation ---------------------------------------------------------------------
@dataclass
class TPGenerateResult:
    completions: list[CompletionResult]  # in the prompts' order
    startup_report: str  # rank 0's engine
    num_preemptions: int
    free_pages: list[dict[str, int]]  # per rank after the run; every page back in its pool


@dataclass(frozen=True)
class GenerateSummary:
    """What `autoopt generate` prints besides the completion (the engine lived in rank 0)."""

    startup_report: str
    tokenizer: Any


def _generate_rank(group: TPGroup, config: EngineConfig, prompts: list[list[int]],
                   params) -> dict[str, Any]:
    engine, control = start_rank(config, group)
    out: dict[str, Any] = {}
    if group.rank == 0:
        out["completions"] = engine.generate(prompts, params)
        engine.runner.stop_workers()
        out["report"] = engine.startup_report
        out["preemptions"] = engine.scheduler.num_preemptions
    else:
        follow_steps(engine, control)
    engine.cache.check_no_leaks(set())  # the replayed frees gave every page back
    out["free"] = {name: pool.num_free for name, pool in engine.cache.pools.items()}
    return out


def generate_tp(config: EngineConfig, prompts: Sequence[Sequence[int]],
                params: SamplingParams | Sequence[SamplingParams] | None = None,
                threads: int | None = None, timeout_s: float | None = None) -> TPGenerateResult:
    """`LLMEngine.generate` on `config.tp` ranks (spawned here, or this process under torchrun).

    `threads`: torch CPU threads per spawned rank (launch's default: cores / tp on CPU).
    """
    check_layout(config)
    ranks = launch(_generate_rank, config.tp, backend_for(config),
                   args=(config, [list(p) for p in prompts], params), timeout_s=timeout_s,
                   threads=threads)
    first = ranks[0]
    return TPGenerateResult(first["completions"], first["report"], first["preemptions"],
                            [r["free"] for r in ranks])


def run_generate_tp(config: EngineConfig, req) -> tuple[CompletionResult | None,
                                                        GenerateSummary | None]:
    """`autoopt generate --tp N` (req: offline.GenerateRequest); (None, None) on torchrun ranks
    other than 0, so that only rank 0 prints."""
    from .offline import prompt_token_ids, sampling_params

    tokenizer = load_tokenizer(config.model)
    ids = prompt_token_ids(req, tokenizer)
    out = generate_tp(config, [ids], sampling_params(req))
    if _under_torchrun() and int(os.environ["RANK"]) != 0:
        return None, None
    return out.completions[0], GenerateSummary(out.startup_report, tokenizer)
