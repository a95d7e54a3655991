"""What the OpenAI and Anthropic endpoints share: the server context, prompts, limits, starting.

Tool choice (docs/format.md leaves it to the server):
- `auto`: tools are shown to the model; it decides.
- `none`: tools are not shown, and a call the model writes anyway is dropped from the response
  (it appears neither as a tool call nor as text).
- `required`: the generation prompt pre-fills `<|channel|>analysis<|message|>`, and when the
  reasoning closes the server writes `<|start|>assistant to=`, so the model must name a tool. A
  name that is not in `tools` is returned as the model wrote it.
- named: as `required`, with ` to=NAME<|channel|>analysis <|constrain|>xml<|message|>` forced, so
  the model writes only the arguments. With reasoning effort `none` the call header is pre-filled
  right after the (empty) reasoning.

Prompts are rendered and tokenized off the event loop (the API modules call `prepare` in a
worker thread), and a prompt's size in bytes is checked first: no token of the vocabulary covers
more than `longest token` bytes, so a text longer than max-model-len times that cannot fit and is
refused without being tokenized.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError

from model.serve.chat_template import REASONING_BUDGET, REASONING_EFFORTS
from model.serve.engine.async_engine import EngineDeadError
from model.serve.engine.generation import (
    EngineProtocol,
    Finished,
    GenerationRequest,
    TextChunk,
    run_generation,
)
from model.serve.engine.outputs import RequestFailedError
from model.serve.engine.sampler import RequestError
from model.serve.http.errors import APIError, internal_error, short
from model.serve.http.metrics import ServerMetrics
from model.serve.http.tools import ToolMode
from model.serve.tokenizer import SPECIAL_TOKENS, BeamTokenizer

ANALYSIS_OPEN = "<|channel|>analysis<|message|>"


@dataclass
class ServeContext:
    engine: EngineProtocol
    tokenizer: BeamTokenizer
    model_name: str
    max_model_len: int
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    created: int = field(default_factory=lambda: int(time.time()))

    @functools.cached_property
    def hidden_ids(self) -> frozenset[int]:
        """Control tokens outside the chat format (special ones, and `<|...|>` ones such as a
        vocabulary's reserved tokens): chat responses leave them out of reasoning and content."""
        added = self.tokenizer.tokenizer.get_added_tokens_decoder().items()
        return frozenset(
            i for i, t in added if t.content not in SPECIAL_TOKENS
            and (t.special or (t.content.startswith("<|") and t.content.endswith("|>"))))

    @functools.cached_property
    def vocab_size(self) -> int:
        """The model's vocabulary (top_k's bound); the tokenizer's when the engine has none."""
        size = getattr(self.engine, "vocab_size", None)
        return size if isinstance(size, int) else self.tokenizer.vocab_size

    @functools.cached_property
    def max_prompt_bytes(self) -> int:
        """Bytes of text that could still fit in max-model-len tokens (see the module doc)."""
        vocab = self.tokenizer.tokenizer.get_vocab(with_added_tokens=True)
        longest = max((len(t.encode("utf-8")) for t in vocab), default=1)
        # A normalizer may shrink text before it is split; leave it room.
        slack = 1 if self.tokenizer.tokenizer.normalizer is None else 4
        return self.max_model_len * max(longest, 1) * slack

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"the model {short(name)} does not exist; this server serves "
                           f"{self.model_name!r} (see GET /v1/models)", param="model",
                           code="model_not_found")

    def encode(self, text: str, param: str) -> list[int]:
        """Token ids of `text`, refusing text too long to fit before tokenizing it."""
        size = len(text.encode("utf-8", errors="surrogatepass"))
        if size > self.max_prompt_bytes:
            raise APIError(400, f"the prompt is {size} bytes; at most {self.max_prompt_bytes} "
                           f"bytes can fit in this server's max-model-len of "
                           f"{self.max_model_len} tokens; shorten it", param=param,
                           code="context_length_exceeded")
        return self.tokenizer.encode(text)


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


@dataclass
class ChatPrompt:
    prompt_ids: list[int]
    prefill: str
    after_reasoning: str | None
    reasoning_budget: int


def reasoning_effort(effort: str | None) -> str:
    effort = effort or "max"
    if effort not in REASONING_EFFORTS:
        raise APIError(400, f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}, "
                       f"got {short(effort)}", param="reasoning_effort")
    return effort


def chat_prompt(
    ctx: ServeContext,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    mode: ToolMode,
    tool_name: str | None,
    effort: str,
    budget: int | None = None,
) -> ChatPrompt:
    """Render and tokenize a chat; see the module docstring for how tool_choice is enforced."""
    offered = tools if mode != "none" and tools else None
    try:
        text = ctx.tokenizer.apply_chat_template(
            messages, tools=offered, add_generation_prompt=True, reasoning_effort=effort
        )
    except (ValueError, TypeError, KeyError, TemplateError) as e:
        raise APIError(400, f"the messages cannot be rendered with the chat template: {e}",
                       param="messages") from None
    budget = REASONING_BUDGET[effort] if budget is None else budget
    header = None
    if mode == "named":
        header = f" to={tool_name}<|channel|>analysis <|constrain|>xml<|message|>"
    elif mode == "required":
        header = " to="
    prefill, after = "", None
    if header is not None:
        # Effort none: the template already closed an empty reasoning; start the call at once.
        prefill, after = (header, None) if effort == "none" else (ANALYSIS_OPEN, header)
    return ChatPrompt(ctx.encode(text + prefill, "messages"), prefill, after, budget)


def max_tokens_for(ctx: ServeContext, n_prompt: int, requested: int | None, param: str) -> int:
    """Check the prompt and max_tokens against max-model-len; None means 'all the room left'."""
    if n_prompt == 0:
        raise APIError(400, "the prompt is empty; send at least one token", param="prompt")
    if n_prompt >= ctx.max_model_len:
        raise APIError(400, f"the prompt is {n_prompt} tokens, and this server's max-model-len is "
                       f"{ctx.max_model_len}, which leaves no room to generate; shorten the prompt",
                       param="messages", code="context_length_exceeded")
    room = ctx.max_model_len - n_prompt
    if requested is None:
        return room
    if requested < 1:
        raise APIError(400, f"'{param}' must be at least 1, got {requested}", param=param)
    if requested > room:
        raise APIError(400, f"this model's maximum context length is {ctx.max_model_len} tokens; "
                       f"the prompt has {n_prompt} and '{param}' asks for {requested}, more than "
                       f"the {room} left; lower '{param}'", param=param,
                       code="context_length_exceeded")
    return requested


def check_token_ids(ctx: ServeContext, ids: list[int], param: str) -> None:
    vocab = ctx.tokenizer.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise APIError(400, f"'{param}' holds token ids outside the vocabulary [0, {vocab}): "
                       f"{bad[:5]}", param=param)


def generation_request(ctx: ServeContext, req: Any, prompt_ids: list[int], max_tokens: int,
                       stop: list[str], **extra: Any) -> GenerationRequest:
    """Sampling fields shared by every endpoint (unset ones keep the API defaults)."""
    stop_ids = list(ctx.tokenizer.stop_token_ids) + list(getattr(req, "stop_token_ids", None) or [])
    check_token_ids(ctx, stop_ids, "stop_token_ids")
    if req.top_k is not None and req.top_k > ctx.vocab_size:
        raise APIError(400, f"'top_k' is {req.top_k}, more than the vocabulary's {ctx.vocab_size} "
                       "tokens; use 0 or -1 to turn top-k off", param="top_k")
    top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
    return GenerationRequest(
        prompt_ids=prompt_ids, max_tokens=max_tokens, max_model_len=ctx.max_model_len,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=top_k,
        min_p=0.0 if req.min_p is None else req.min_p, seed=req.seed, stop=stop,
        stop_token_ids=stop_ids, **extra,
    )


async def start_generation(
    ctx: ServeContext, greq: GenerationRequest, request_id: str, endpoint: str
) -> AsyncIterator[TextChunk | Finished]:
    """Start a request and wait for its first event, so an engine refusal is still a 4xx.

    The returned iterator records the finish in the metrics; closing it aborts the request.
    """
    arrival = time.monotonic()
    events = run_generation(ctx.engine, ctx.tokenizer, greq, request_id, ctx.metrics, arrival)
    try:
        first = await events.__anext__()
    except BaseException as e:
        await events.aclose()
        if not isinstance(e, Exception):
            raise
        _record(ctx, endpoint, "error" if isinstance(e, RequestFailedError) else "abort",
                len(greq.prompt_ids), 0, arrival)
        raise _api_error(e, request_id) from None
    return _recorded(ctx, first, events, endpoint, arrival, request_id, len(greq.prompt_ids))


def _api_error(e: Exception, request_id: str) -> Exception:
    if isinstance(e, APIError):
        return e
    if isinstance(e, RequestError | ValueError):  # the engine refused the request
        return APIError(400, str(e))
    if isinstance(e, RequestFailedError):
        return internal_error(request_id, e.stage)
    if isinstance(e, EngineDeadError):
        return APIError(503, "the engine has stopped on an internal error and this server is "
                        "shutting down; retry once it has been restarted", code="engine_dead")
    return e  # unexpected: the app's handler logs it and answers a generic 500


def _record(ctx: ServeContext, endpoint: str, reason: str, n_prompt: int, n_completion: int,
            arrival: float) -> None:
    ctx.metrics.finish(endpoint, reason, n_prompt, n_completion, time.monotonic() - arrival)


async def _recorded(
    ctx: ServeContext, first: TextChunk | Finished, events: AsyncIterator[TextChunk | Finished],
    endpoint: str, arrival: float, request_id: str, n_prompt: int,
) -> AsyncIterator[TextChunk | Finished]:
    reason, n_completion = "abort", 0  # unless it finishes: the client went away
    try:
        event = first
        while True:
            if isinstance(event, Finished):
                reason, n_completion = event.reason, event.completion_tokens
            else:
                n_completion += len(event.token_ids)
            yield event
            if isinstance(event, Finished):
                return
            try:
                event = await events.__anext__()
            except Exception as e:
                reason = "error" if isinstance(e, RequestFailedError | EngineDeadError) else reason
                raise _api_error(e, request_id) from None
    finally:
        _record(ctx, endpoint, reason, n_prompt, n_completion, arrival)
        await events.aclose()  # type: ignore[attr-defined]
