"""The serving engine: requests in, tokens out (no HTTP here).

`LLMEngine` (llm_engine.py) steps a `Scheduler` over a paged KV cache (kv_cache.py) through the
`ModelRunner` (model/serve/runner.py and its attention backends) and a `Sampler`; `AsyncEngine`
runs it on a background thread for asyncio callers; `generation.py` drives one API request
through it (stop strings, reasoning budget); `faults.py` decides which failures stay with their
request and which stop the engine; `batch_invariant.py` is the mode in which batching never
changes a token; `offline.py` and `tp_worker.py` are `autoopt generate` and the tensor-parallel
ranks.

The names below are imported on first use, so `model.serve.engine.kv_cache` (which the attention
backends import) can load without pulling in the runner that imports them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "AsyncEngine": "async_engine",
    "EngineDeadError": "async_engine",
    "EngineConfig": "llm_engine",
    "LLMEngine": "llm_engine",
    "CompletionResult": "outputs",
    "EngineStats": "outputs",
    "RequestOutput": "outputs",
    "RequestError": "sampler",
    "SamplingParams": "sampler",
}
__all__ = ["AsyncEngine", "CompletionResult", "EngineConfig", "EngineDeadError", "EngineStats",
           "LLMEngine", "RequestError", "RequestOutput", "SamplingParams"]

if TYPE_CHECKING:
    from .async_engine import AsyncEngine, EngineDeadError
    from .llm_engine import EngineConfig, LLMEngine
    from .outputs import CompletionResult, EngineStats, RequestOutput
    from .sampler import RequestError, SamplingParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
