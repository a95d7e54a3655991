"""The step as the server runs it: `model/serve`'s engine over a pre-filled paged KV cache.

`ServedStep` builds an `LLMEngine` around a rank model (the runner, the paged KV cache, CUDA
graphs for decode on a GPU, the chosen attention backend) and serves real sequences through it:
- decode: `batch` sequences whose first `context - 1` tokens are already in the cache (pages
  allocated through the cache, filled with random K/V on the device, as a long-running server's
  cache would be), each decoding its next token; one `step()` is one `engine.step()`: schedule,
  the runner (a CUDA-graph replay on a GPU), sampling. Every row is a real sequence with its own
  pages and tokens (routing changes with the tokens, so padding rows would not do the same work);
  the graph bucket pads only where `batch` is not a bucket, and says so.
- prefill: `batch` fresh prompts of `context` tokens admitted and prefilled in one step (the
  scheduler's token budget is `batch * context`), one `step()` each time.

The engine's own code runs every token: there is no second attention path or op resolution here.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from model import beam
from model.beam import BeamForCausalLM
from model.serve.engine import EngineConfig, LLMEngine
from model.serve.engine.kv_cache import FULL, SWA, KVLayout
from model.serve.engine.sampler import SamplingParams
from model.serve.engine.scheduler import Status

PAGE_SIZE = 16
BACKEND_RANGE = "paged_attention"  # the attention backend (its range holds the attention op)


class RangedBackend:
    """The runner's attention backend inside a named range (for the eager labelling and
    inventory passes); the KV write is the Q/K norm ops', the attention the op's."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __call__(self, *args, **kwargs):
        with beam.region(BACKEND_RANGE):  # looked up per call: the inventory counts it
            return self.inner(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


@dataclass(frozen=True)
class ServeShape:
    """What the engine is sized for: phase, the most sequences, context, steps it must last."""

    phase: str
    max_batch: int
    context: int
    steps: int = 64  # decode tokens each sequence may still generate

    def __post_init__(self) -> None:
        if self.phase not in ("decode", "prefill"):
            raise ValueError(f"phase must be decode or prefill, got {self.phase!r}")
        if self.max_batch < 1 or self.context < 2 or self.steps < 1:
            raise ValueError(f"need max_batch >= 1, context >= 2, steps >= 1: {self}")

    @property
    def max_model_len(self) -> int:
        # Tight on purpose: the torch decode path gathers max_model_len keys per row.
        return self.context + (self.steps if self.phase == "decode" else 1)

    @property
    def max_num_batched_tokens(self) -> int:
        return self.max_batch * (self.context if self.phase == "prefill" else 1)


def kv_budget(model: BeamForCausalLM, shape: ServeShape, page_size: int = PAGE_SIZE) -> int:
    """Exactly the KV bytes the engine needs for `shape` (the window reserve plus every
    sequence's full-attention pages at max_model_len, plus the null pages)."""
    lay = KVLayout.for_model(model.config, model.shard, page_size, model.dtype)
    swa = lay.swa_reserve(shape.max_batch, shape.max_num_batched_tokens, shape.max_model_len)
    full = 1 + shape.max_batch * (math.ceil(shape.max_model_len / page_size) + 1)
    total = swa * lay.page_bytes(SWA)
    if lay.full_layers:
        total += full * lay.page_bytes(FULL)
    return max(total, 1)


def engine_config(model: BeamForCausalLM, shape: ServeShape, *, cuda_graphs: bool,
                  attention_backend: str, seed: int = 0) -> EngineConfig:
    """The engine for `shape`: the model's own ops (kernels=None), a KV budget sized exactly."""
    return EngineConfig(
        device=str(model.device), dtype="bfloat16" if model.dtype == torch.bfloat16 else
        "float32", kernels=None, max_num_seqs=shape.max_batch, max_model_len=shape.max_model_len,
        max_num_batched_tokens=shape.max_num_batched_tokens, page_size=PAGE_SIZE,
        kv_cache_bytes=kv_budget(model, shape), cuda_graphs=cuda_graphs,
        attention_backend=attention_backend, seed=seed)


class ServedStep:
    """An engine over `model` serving real sequences of `shape`; see the module docstring."""

    def __init__(self, model: BeamForCausalLM, shape: ServeShape, *, cuda_graphs: bool = True,
                 attention_backend: str = "auto", seed: int = 0,
                 batched_decode: bool | None = None) -> None:
        self.shape, self.seed = shape, seed
        start = time.perf_counter()
        self.engine = LLMEngine(engine_config(model, shape, cuda_graphs=cuda_graphs,
                                              attention_backend=attention_backend, seed=seed),
                                model=model)
        if batched_decode is not None:  # the meta-device inventory mirrors a GPU's decode path
            self.engine.runner.batched_decode = batched_decode
        self.build_s = time.perf_counter() - start
        self.model = model
        self.batch = 0
        self._ids = 0
        self._left = 0
        self._live: list[str] = []
        self._gen = torch.Generator().manual_seed(seed)
        if model.device.type != "meta":
            self._fill_cache()

    # ---- facts --------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def graphs(self):
        return self.engine.runner.graphs

    @property
    def notes(self) -> list[str]:
        return list(self.engine.runner.notes)

    def bucket(self) -> int | None:
        """The CUDA-graph bucket a decode of `batch` sequences replays, None when eager."""
        g = self.graphs
        if g is None or self.shape.phase != "decode" or not self.batch:
            return None
        return g.bucket(self.batch)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- sequences ----------------------------------------------------------------------------
    def _fill_cache(self) -> None:
        """Random K/V everywhere but the null page (page 0 stays zero: padded rows read it)."""
        g = torch.Generator(device=self.device).manual_seed(self.seed + 1)
        cache = self.engine.cache
        for pool in (cache.k, cache.v):
            for t in pool.values():
                if t.numel():
                    t.normal_(generator=g)
                    t[:, 0].zero_()

    def _prompt(self, n: int) -> list[int]:
        vocab = self.engine.model_config.vocab_size
        return torch.randint(0, vocab, (n,), generator=self._gen).tolist()

    def start(self, batch: int) -> None:
        """Serve `batch` sequences from now on (decode: pre-filled to context - 1 tokens)."""
        if not 1 <= batch <= self.shape.max_batch:
            raise ValueError(f"batch {batch} must be within 1..{self.shape.max_batch} (the "
                             "engine's max_num_seqs)")
        self.stop()
        self.batch = batch
        if self.shape.phase == "decode":
            self._prefilled(batch)

    def _prefilled(self, batch: int) -> None:
        eng, ctx = self.engine, self.shape.context
        params = SamplingParams(max_tokens=self.shape.steps, temperature=0.0, ignore_eos=True)
        sched = eng.scheduler
        for _ in range(batch):
            rid = self._add(self._prompt(ctx), params)
            seq = sched.waiting[-1]
            assert seq.request_id == rid
            # The first context - 1 tokens are in the cache already: pages allocated (their K/V
            # is the cache's random content), the last prompt token is this step's decode.
            sched.waiting.remove(seq)
            seq.status = Status.RUNNING
            sched.running.append(seq)
            self._allocate(seq.seq_id, ctx - 1)
            seq.num_computed = ctx - 1
        self._left = self.shape.steps

    def _allocate(self, seq_id: int, n: int) -> None:
        """Pages for n cached tokens, in chunks the window pool can hold (a chunk needs window
        pages for all its tokens until trimmed, as a prefill chunk would)."""
        cache, chunk = self.engine.cache, n
        while n:
            chunk = min(chunk, n)
            while chunk > 1 and not cache.can_allocate(seq_id, chunk):
                chunk //= 2
            cache.allocate(seq_id, chunk)
            cache.trim(seq_id)
            n -= chunk

    def _add(self, prompt: list[int], params: SamplingParams) -> str:
        self._ids += 1
        rid = f"served-{self._ids}"
        self.engine.add_request(rid, prompt, params)
        self._live.append(rid)
        return rid

    def stop(self) -> None:
        """Finish every sequence (their pages go back to the cache)."""
        eng = self.engine
        for rid in self._live:
            eng.abort(rid)
        self._live = []
        eng.step()  # delivers the aborts; nothing is scheduled
        self.batch, self._left = 0, 0

    def admit(self) -> None:
        """Prefill: queue `batch` fresh prompts of `context` tokens for the next step."""
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        self._live = []  # the last step's prompts finished with it
        for _ in range(self.batch):
            self._add(self._prompt(self.shape.context), params)

    def steps_left(self) -> int:
        return self._left if self.shape.phase == "decode" else 1 << 30

    def ensure(self, steps: int) -> None:
        """Restart the sequences if fewer than `steps` decode tokens are left to them."""
        if self.shape.phase == "decode" and self._left < steps:
            if steps > self.shape.steps:
                raise ValueError(f"{steps} steps asked, the engine was sized for "
                                 f"{self.shape.steps}")
            self.start(self.batch)

    # ---- one step -----------------------------------------------------------------------------
    def step(self) -> float:
        """One served step; returns its wall time in seconds (host clock, synchronised)."""
        if not self.batch:
            raise RuntimeError("call start(batch) first")
        eng = self.engine
        if self.shape.phase == "prefill":
            self.admit()
        else:
            self.ensure(1)
        before = eng._counters["batched"]
        self.synchronize()
        t0 = time.perf_counter()
        eng.step()
        self.synchronize()
        took = time.perf_counter() - t0
        want = self.batch * (self.shape.context if self.shape.phase == "prefill" else 1)
        done = eng._counters["batched"] - before
        if done != want:
            raise RuntimeError(f"the step ran {done} tokens, expected {want} (the engine was "
                               "sized for this shape: report this as a bug)")
        self._left -= 1
        return took

    @contextlib.contextmanager
    def eager(self) -> Iterator[list[torch.Tensor]]:
        """Steps inside run the decode graph's forward eagerly (the same static-buffer forward
        the graph captured) with the attention backend in its range; yields the list the steps'
        logits are appended to (the labelling, inventory and parity passes)."""
        runner = self.engine.runner
        graphs, backend = runner.graphs, self.model.attention_backend
        seen: list[torch.Tensor] = []
        execute = runner.execute

        def capture(chunks):
            out = execute(chunks)
            seen.append(out)
            return out

        runner.execute = capture
        self.model.attention_backend = RangedBackend(backend)
        if graphs is not None:
            graphs.replay = False
        try:
            yield seen
        finally:
            del runner.execute  # back to the class's method
            self.model.attention_backend = backend
            if graphs is not None:
                graphs.replay = True

    def forward_only(self) -> None:
        """Schedule and run one step's forward without sampling (the meta-device inventory,
        where there are no values to sample from)."""
        eng = self.engine
        if self.shape.phase == "prefill":
            self.admit()
        sched = eng.scheduler.schedule()
        eng.runner.execute(sched.chunks)
        eng.scheduler.advance(sched)

    def close(self) -> None:
        """Release the engine's cache and graphs (the model stays)."""
        import gc

        if self.engine is not None:
            runner = self.engine.runner
            if runner.graphs is not None:
                runner.graphs.graphs.clear()
                runner.graphs.logits.clear()
            self.engine = None  # type: ignore[assignment]
            # The model's attention backend holds this engine's KV cache: let it go now, not
            # when the next engine (which allocates its own cache first) replaces it.
            self.model.attention_backend = beam.CausalAttention(self.model.ops)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
