"""The serving engine: requests in, tokens out, one scheduler step at a time.

`LLMEngine` is synchronous (`add_request`, `step`, `abort`, offline `generate`); `AsyncEngine`
(async_engine.py) runs it on a background thread for the HTTP API. A bad request raises
`RequestError` before anything is queued; a request that fails later ends with finish_reason
"error" (faults.py).
"""

from __future__ import annotations

import inspect
import itertools
import logging
import random
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import torch

from ...beam import Batch, BeamForCausalLM, CausalAttention
from ...ops.precision import use_contract_precision
from .. import attention_backends
from ..runner import ModelRunner
from .batch_invariant import TokenwiseRunner
from .faults import StepIsolation
from .kv_cache import KVLayout, PagedKVCache
from .outputs import (
    FINISH_REASONS,
    CompletionResult,
    EngineStats,
    RequestFailedError,
    RequestOutput,
    RequestState,
)
from .sampler import (
    RequestError,
    Sampler,
    SampleRequest,
    SamplingParams,
    make_generator,
    sample_isolated,
)
from .scheduler import Scheduler, SchedulerConfig, Sequence

log = logging.getLogger(__name__)
CPU_KV_CACHE_BYTES = 512 * 2**20
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
          "fp32": torch.float32}


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # checkpoint directory (HF layout); None when a model is passed in
    device: str = "auto"  # auto = cuda when available, else cpu
    dtype: str = "bfloat16"
    # reference | tuned | path to a registry lock file. A model passed to LLMEngine gets this
    # set's ops; None keeps the passed model's own ops (loading a checkpoint: tuned).
    kernels: str | None = "tuned"
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    max_num_batched_tokens: int = 2048
    gpu_memory_utilization: float = 0.9
    kv_cache_bytes: int | None = None  # KV budget; None: 512 MiB on CPU, from free memory on GPU
    page_size: int = 16
    cuda_graphs: bool = True  # GPU only
    seed: int = 0
    tp: int = 1  # tensor-parallel ranks (engine/tp_worker.py starts them)
    ep: int = 1  # expert parallelism: 1 (experts split by TP) or tp (experts split across ranks)
    # The attention op's variant: auto (the lock) | torch | triton | flashinfer | a variant name
    # (model/serve/attention_backends.py).
    attention_backend: str = "auto"
    registry: str | None = None  # the registry DIR kernels and their lock come from (None: default)
    batch_invariant: bool = False  # one forward per token: batching never changes a token

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPES)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        attention_backends.check_name(self.attention_backend)
        if self.ep not in (1, self.tp):
            raise ValueError(f"ep={self.ep} must be 1 (experts split by TP) or equal to "
                             f"tp={self.tp} (experts split across the ranks)")
        for name in ("max_num_seqs", "max_num_batched_tokens", "page_size", "kv_cache_bytes",
                     "tp"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


def load_engine_model(config: EngineConfig) -> BeamForCausalLM:
    from ... import weights

    if config.model is None:
        raise ValueError("EngineConfig.model is None and no model was passed to the engine")
    if config.tp > 1:
        raise ValueError(f"EngineConfig(tp={config.tp}) needs one process per rank: start the "
                         "ranks with model.serve.engine.tp_worker (generate_tp, or `autoopt serve/"
                         "generate --tp N`), not LLMEngine(config) in one process")
    kwargs = {"dtype": config.torch_dtype, "device": str(config.resolved_device())}
    if "kernels" in inspect.signature(weights.load_model).parameters:
        kwargs["kernels"] = config.kernels or "tuned"
        kwargs["registry"] = config.registry
    return weights.load_model(config.model, **kwargs)


def apply_kernels(model: BeamForCausalLM, kernels: str, registry: str | None = None) -> None:
    """Give a model passed to the engine the ops of `EngineConfig.kernels` (for its device's
    arch, from `registry`); its collectives (TP) stay as attached."""
    from ...registry import resolve_ops

    model.set_ops(resolve_ops(kernels, registry, device=model.device, dtype=model.dtype))
    log.info("engine: the passed model runs --kernels %s", kernels)


def load_tokenizer(path: str | None):
    from ..tokenizer import BeamTokenizer

    if path is None or not (Path(path) / "tokenizer.json").exists():
        return None
    return BeamTokenizer.from_pretrained(path)


class LLMEngine:
    isolate_step_failures = True  # a failing step is re-run per request (faults.py)

    def __init__(self, config: EngineConfig, model: BeamForCausalLM | None = None,
                 tokenizer=None) -> None:
        self.config = config
        use_contract_precision()  # GEMMs round as the op contracts say (model/ops/precision.py)
        if model is not None and config.kernels is not None:
            apply_kernels(model, config.kernels, config.registry)
        self.model = model if model is not None else load_engine_model(config)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model)
        self.model_config = self.model.config
        self.device = self.model.device
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.vocab_size = self.model_config.vocab_size
        layout = KVLayout.for_model(self.model_config, self.model.shard, config.page_size,
                                    self.model.dtype)
        self.cache = PagedKVCache.from_budget(
            layout, self._kv_budget(), config.max_num_seqs, config.max_num_batched_tokens,
            self.max_model_len, self.device)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens), self.cache)
        self.runner = ModelRunner(self.model, self.cache, max_num_seqs=config.max_num_seqs,
                                  max_model_len=self.max_model_len, cuda_graphs=config.cuda_graphs,
                                  attention_backend=config.attention_backend,
                                  registry=config.registry)
        if config.batch_invariant:
            self.runner = TokenwiseRunner(self.runner)
        self.sampler = Sampler()
        self._isolation = StepIsolation(enabled=self.isolate_step_failures)
        eos = self.model_config.eos_token_id
        self.stop_token_ids = frozenset(
            self.tokenizer.stop_token_ids if self.tokenizer is not None
            else ([eos] if isinstance(eos, int) else (eos or [])))
        self._rng = random.Random(config.seed)
        self._ids = itertools.count()
        self._requests: dict[str, Sequence] = {}
        self._pending: list[RequestOutput] = []
        self._counters = {"prompt": 0, "generation": 0, "added": 0, "steps": 0, "batched": 0}
        self._finished = {reason: 0 for reason in FINISH_REASONS}
        self.startup_report = (
            f"KV cache: {self.cache.capacity_tokens} tokens of context "
            f"({self.cache.nbytes() / 2**20:.1f} MiB, pages of {config.page_size}: "
            f"{self.cache.pools['full'].num_usable} full-attention, "
            f"{self.cache.pools['swa'].num_usable} sliding-window), max_model_len "
            f"{self.max_model_len}, on {self.device}" + "".join(f"; {n}" for n in
                                                                 self.runner.notes))
        log.info(self.startup_report)

    def _kv_budget(self) -> int:
        if self.config.kv_cache_bytes is not None:
            return self.config.kv_cache_bytes
        if self.device.type != "cuda":
            return CPU_KV_CACHE_BYTES
        free, total = torch.cuda.mem_get_info(self.device)
        activations = self._profile_activations()
        budget = free - (1 - self.config.gpu_memory_utilization) * total - activations
        return max(int(budget), 0)

    def _profile_activations(self) -> int:
        """Peak memory of a forward over a full token budget, plus the attention scores of
        that many queries against max_model_len keys (the eager attention's largest buffer)."""
        n = self.config.max_num_batched_tokens
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        backend, self.model.attention_backend = (self.model.attention_backend,
                                                 CausalAttention(self.model.ops))
        self.model.forward_tokens(ids, torch.arange(n, device=self.device),
                                  Batch(torch.arange(n, device=self.device), [(0, n)]))
        self.model.attention_backend = backend
        torch.cuda.empty_cache()  # the KV cache takes what the profile run left cached
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        # BF16 scores and probs, FP32 softmax, the mask: ~12 bytes per (head, query, key).
        scores = n * self.max_model_len * self.model.shard.num_attention_heads * 12
        logits = self.config.max_num_seqs * self.model.shard.vocab_size * 16
        return peak + scores + logits

    # ---- requests ---------------------------------------------------------------------------
    def check_request(self, prompt_token_ids: Seq[int], params: SamplingParams) -> None:
        """Raise RequestError for a request the engine cannot serve (nothing is queued)."""
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestError("the prompt is empty; send at least one token")
        vocab = self.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token id {bad[0]!r} is outside the vocabulary "
                               f"[0, {self.vocab_size})")
        if n + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the "
                f"request asks for {n} prompt tokens + {params.max_tokens} max_tokens; shorten "
                "the prompt or lower max_tokens")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer and this checkpoint has none; "
                               "use stop_token_ids")
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"stop token id {bad[0]} is outside [0, {self.vocab_size})")
        if params.top_k > self.vocab_size:
            raise RequestError(f"top_k {params.top_k} is larger than the vocabulary "
                               f"({self.vocab_size} tokens); use 0 or -1 to turn top-k off")

    def add_request(self, request_id: str, prompt_token_ids: Seq[int],
                    params: SamplingParams) -> None:
        """Queue a request. RequestError: refused (nothing queued); RequestFailedError: building
        its state failed (nothing queued); anything else: the queues may be inconsistent."""
        self.check_request(prompt_token_ids, params)
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already running; ids must be unique")
        try:
            seq = self._new_sequence(request_id, prompt_token_ids, params)
        except Exception as exc:
            log.error("request %s failed while starting", request_id, exc_info=exc)
            self._finished["error"] += 1
            raise RequestFailedError(request_id, "starting") from exc
        self._requests[request_id] = seq
        self.scheduler.add(seq)
        self._counters["added"] += 1
        self._counters["prompt"] += len(prompt_token_ids)

    def _new_sequence(self, request_id: str, prompt_token_ids: Seq[int],
                      params: SamplingParams) -> Sequence:
        seq = Sequence(request_id, list(prompt_token_ids))
        gen = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else self._rng.randrange(2**63)
            gen = make_generator(seed, self.device)
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else self.stop_token_ids)
        decoder = (self.tokenizer.incremental_decoder(params.skip_special_tokens)
                   if self.tokenizer is not None else None)
        seq.state = RequestState(
            params, SampleRequest(params, gen), frozenset(stops), decoder, time.monotonic(),
            len(prompt_token_ids) + params.max_tokens,
            self.tokenizer.vocab_size if self.tokenizer is not None else 0)
        return seq

    def abort(self, request_id: str) -> bool:
        """Stop a request; its final output (finish_reason "abort") comes with the next step."""
        seq = self._requests.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq)
        st = seq.state
        st.finish_reason = "abort"
        self._finished["abort"] += 1
        self._pending.append(self._output(seq, [], None, "", time.monotonic()))
        return True

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._pending)

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run and sample one step. A request whose step, sampling or detokenization
        fails finishes with finish_reason "error" (faults.py); an error in what all requests
        share raises (EngineFatalError, or the scheduler's own error) and the engine must stop."""
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        if not sched.chunks:
            return outputs
        logits, failed = self._isolation.execute(self.runner, sched.chunks)
        self.scheduler.advance(sched)
        now = time.monotonic()
        for i, exc in failed.items():
            outputs.append(self._fail(sched.chunks[i].seq, "running its model step", exc, now))
        seqs = [c.seq for i, c in enumerate(sched.chunks) if c.sample and i not in failed]
        tokens, logprobs, errors = sample_isolated(self.sampler, logits,
                                                   [s.state.sample for s in seqs])
        for seq, token, lp, exc in zip(seqs, tokens, logprobs, errors):
            if exc is not None:
                outputs.append(self._fail(seq, "sampling its next token", exc, now))
                continue
            try:
                outputs.append(self._append(seq, token, lp, now))
            except Exception as exc:  # noqa: BLE001 - detokenizing or stop checks: this request
                outputs.append(self._fail(seq, "detokenizing its output", exc, now))
        self._counters["steps"] += 1
        self._counters["batched"] += sched.num_tokens
        self._counters["generation"] += len(seqs) - sum(e is not None for e in errors)
        return outputs

    def _fail(self, seq: Sequence, stage: str, exc: BaseException, now: float) -> RequestOutput:
        log.error("request %s failed while %s; it is ended, the engine goes on", seq.request_id,
                  stage, exc_info=exc)
        if self._requests.pop(seq.request_id, None) is not None:
            self.scheduler.finish(seq)
            self._finished["error"] += 1
        st = seq.state
        st.finish_reason, st.error = "error", stage
        return self._output(seq, [], None, "", now)

    def _append(self, seq: Sequence, token: int, lp, now: float) -> RequestOutput:
        st = seq.state
        seq.output_ids.append(token)
        if st.first_token_time is None:
            st.first_token_time = now
        if lp is not None:
            st.logprobs.append(lp)
        delta = st.add_token(token, len(seq.output_ids), seq.num_tokens)
        if st.finish_reason is not None:
            self.scheduler.finish(seq)
            self._requests.pop(seq.request_id, None)
            self._finished[st.finish_reason] += 1
        return self._output(seq, [token], lp, delta, now)

    def _output(self, seq: Sequence, new: list[int], lp, delta: str, now: float) -> RequestOutput:
        st = seq.state
        return RequestOutput(
            request_id=seq.request_id, new_token_ids=new, token_ids=list(seq.output_ids),
            text_delta=delta, text=st.text[: st.emitted], finished=st.finish_reason is not None,
            finish_reason=st.finish_reason, stop_reason=st.stop_reason,
            logprobs=[lp] if lp is not None else ([] if st.params.logprobs is not None else None),
            prompt_tokens=len(seq.prompt_ids), completion_tokens=len(seq.output_ids),
            arrival_time=st.arrival_time, first_token_time=st.first_token_time, time=now,
            error=st.error)

    # ---- offline ----------------------------------------------------------------------------
    def generate(self, prompts: Seq[Seq[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None
                 ) -> list[CompletionResult]:
        """Run every prompt to completion (batched); results in the prompts' order."""
        params = params if params is not None else SamplingParams()
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, plist):
            self.add_request(rid, prompt, p)
        done: dict[str, CompletionResult] = {}
        seqs = {rid: self._requests[rid] for rid in ids}
        while len(done) < len(ids):
            for out in self.step():
                if out.finished and out.request_id in seqs:
                    st = seqs[out.request_id].state
                    done[out.request_id] = CompletionResult(
                        out.request_id, list(seqs[out.request_id].prompt_ids), out.token_ids,
                        out.text, out.finish_reason, out.stop_reason,
                        st.logprobs if st.params.logprobs is not None else None,
                        out.arrival_time, out.first_token_time, out.time)
        return [done[rid] for rid in ids]

    def stats(self) -> EngineStats:
        c = self._counters
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_usage=self.cache.usage(), kv_capacity_tokens=self.cache.capacity_tokens,
            max_model_len=self.max_model_len, num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens_total=c["prompt"], generation_tokens_total=c["generation"],
            requests_added_total=c["added"], requests_finished_total=dict(self._finished),
            steps_total=c["steps"], batched_tokens_total=c["batched"])

