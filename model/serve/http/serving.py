"""What the OpenAI and Anthropic endpoints share: the server context, prompts, limits, starting.

Tool choice (FORMAT.md leaves it to the server):
- `auto`: tools are shown to the model; it decides.
- `none`: tools are not shown, and a call the model writes anyway is dropped from the response
  (it appears neither as a tool call nor as text).
- `required`: the generation prompt pre-fills `<|channel|>analysis<|message|>`, and when the
  reasoning closes the server writes `<|start|>assistant to=`, so the model must name a tool. A
  name that is not in `tools` is returned as the model wrote it.
- named: as `required`, with ` to=NAME<|channel|>analysis <|constrain|>xml<|message|>` forced, so
  the model writes only the arguments. With reasoning effort `none` the call header is pre-filled
  right after the (empty) reasoning.
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
from model.serve.http.metrics import Metrics
from model.serve.http.protocol import APIError, ToolMode
from model.serve.tokenizer import SPECIAL_TOKENS, BeamTokenizer

ANALYSIS_OPEN = "<|channel|>analysis<|message|>"


@dataclass
class ServeContext:
    engine: EngineProtocol
    tokenizer: BeamTokenizer
    model_name: str
    max_model_len: int
    api_key: str | None = None
    metrics: Metrics = field(default_factory=Metrics)
    created: int = field(default_factory=lambda: int(time.time()))

    @functools.cached_property
    def hidden_ids(self) -> frozenset[int]:
        """Control tokens outside the chat format (special ones, and `<|...|>` ones such as a
        vocabulary's reserved tokens): chat responses leave them out of reasoning and content."""
        added = self.tokenizer.tokenizer.get_added_tokens_decoder().items()
        return frozenset(
            i for i, t in added if t.content not in SPECIAL_TOKENS
            and (t.special or (t.content.startswith("<|") and t.content.endswith("|>"))))

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                           f"{self.model_name!r} (see GET /v1/models)", param="model",
                           code="model_not_found")


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
                       f"got {effort!r}", param="reasoning_effort")
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
    return ChatPrompt(ctx.tokenizer.encode(text + prefill), prefill, after, budget)


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
    except ValueError as e:  # the engine's RequestError: the request cannot be served
        await events.aclose()
        raise APIError(400, str(e)) from None
    except EngineDeadError as e:
        await events.aclose()
        raise APIError(503, f"the engine is not serving: {e}; restart the server") from None
    return _recorded(ctx, first, events, endpoint, arrival, len(greq.prompt_ids))


async def _recorded(
    ctx: ServeContext, first: TextChunk | Finished, events: AsyncIterator[TextChunk | Finished],
    endpoint: str, arrival: float, n_prompt: int,
) -> AsyncIterator[TextChunk | Finished]:
    finished = False
    try:
        event = first
        while True:
            if isinstance(event, Finished):
                finished = True
                ctx.metrics.finish(endpoint, event.reason, event.prompt_tokens, arrival)
            yield event
            if isinstance(event, Finished):
                return
            event = await events.__anext__()
    finally:
        if not finished:  # the client went away (or the stream failed) before the end
            ctx.metrics.finish(endpoint, "abort", n_prompt, arrival)
        await events.aclose()  # type: ignore[attr-defined]
