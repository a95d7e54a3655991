"""Anthropic-compatible `/v1/messages`: thinking, text and tool_use blocks, JSON or SSE events.

Both forms build their content blocks with one `BlockBuilder` from the same parser deltas, so a
non-streaming message holds exactly the blocks the stream announced. Choices:
- `thinking`: `{"type": "disabled"}` is effort `none`; `{"type": "enabled", "budget_tokens": N}`
  uses the smallest effort whose budget covers N and enforces min(N, the largest budget); absent
  (or "adaptive") is Beam's default effort `max`. `reasoning_effort` (not Anthropic's) overrides.
- Thinking blocks carry an empty `signature`: the server does not sign reasoning, and takes
  thinking blocks sent back in history as they are.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from model.serve.chat_template import REASONING_BUDGET
from model.serve.engine.generation import Finished, TextChunk
from model.serve.harmony import Delta, StreamingParser
from model.serve.http.content import anthropic_messages
from model.serve.http.errors import APIError
from model.serve.http.protocol import MessagesRequest, normalize_stop
from model.serve.http.serving import (
    ServeContext,
    chat_prompt,
    generation_request,
    max_tokens_for,
    new_id,
    reasoning_effort,
    start_generation,
)
from model.serve.http.sse import sse, stream_error
from model.serve.http.tools import anthropic_tools_to_openai, resolve_anthropic_tool_choice

_BLOCK_OF = {"reasoning": "thinking", "content": "text"}


def thinking_effort(req: MessagesRequest) -> tuple[str, int | None]:
    """(effort level, budget override) from `thinking` / `reasoning_effort`."""
    if req.reasoning_effort is not None:
        return reasoning_effort(req.reasoning_effort), None
    thinking = req.thinking or {}
    kind = thinking.get("type", "adaptive")
    if kind == "disabled":
        return "none", None
    if kind == "adaptive":
        return reasoning_effort(None), None
    budget = thinking.get("budget_tokens")
    if kind != "enabled" or not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
        raise APIError(400, "'thinking' must be {\"type\": \"disabled\"}, {\"type\": \"adaptive\"} "
                       "or {\"type\": \"enabled\", \"budget_tokens\": N} with N >= 0",
                       param="thinking")
    budget = min(budget, max(REASONING_BUDGET.values()))
    effort = min((b, e) for e, b in REASONING_BUDGET.items() if b >= budget)[1]
    return effort, budget


class BlockBuilder:
    """Parser deltas -> Anthropic stream events, keeping the finished blocks."""

    def __init__(self, tools: list[dict[str, Any]] | None, parse_calls: bool) -> None:
        self.parser = StreamingParser(tools)
        self.parse_calls = parse_calls
        self.blocks: list[dict[str, Any]] = []
        self._open = False

    def feed(self, text: str, final: bool = False) -> list[tuple[str, dict[str, Any]]]:
        deltas = self.parser.feed(text)
        if final:
            deltas += self.parser.finish()
        events: list[tuple[str, dict[str, Any]]] = []
        for d in deltas:
            self._delta(d, events)
        if final:
            self._close(events)
        return events

    @property
    def has_calls(self) -> bool:
        return any(b["type"] == "tool_use" for b in self.blocks)

    def _close(self, events: list[tuple[str, dict[str, Any]]]) -> None:
        if self._open:
            events.append(("content_block_stop",
                           {"type": "content_block_stop", "index": len(self.blocks) - 1}))
            self._open = False

    def _start(self, block: dict[str, Any], events: list[tuple[str, dict[str, Any]]]) -> None:
        self._close(events)
        self.blocks.append(block)
        self._open = True
        events.append(("content_block_start", {"type": "content_block_start",
                                               "index": len(self.blocks) - 1,
                                               "content_block": dict(block)}))

    def _delta(self, d: Delta, events: list[tuple[str, dict[str, Any]]]) -> None:
        if d.kind in _BLOCK_OF:
            kind = _BLOCK_OF[d.kind]
            if not (self._open and self.blocks[-1]["type"] == kind):
                self._start({"type": "thinking", "thinking": "", "signature": ""}
                            if kind == "thinking" else {"type": "text", "text": ""}, events)
            self.blocks[-1][kind] += d.text
            delta = {"type": f"{kind}_delta", kind: d.text}
        elif not self.parse_calls:
            return
        elif d.kind == "tool_call_start":
            self._start({"type": "tool_use", "id": new_id("toolu_"), "name": d.name,
                         "input": {}}, events)
            return
        else:
            self.blocks[-1]["input"] = json.loads(d.arguments)
            delta = {"type": "input_json_delta", "partial_json": d.arguments}
        events.append(("content_block_delta", {"type": "content_block_delta",
                                               "index": len(self.blocks) - 1, "delta": delta}))


def _stop_reason(fin: Finished, has_calls: bool) -> str:
    if fin.stop_sequence is not None:
        return "stop_sequence"
    if fin.reason == "length":
        return "max_tokens"
    return "tool_use" if has_calls and fin.reason == "stop" else "end_turn"


def _setup(ctx: ServeContext, req: MessagesRequest) -> tuple[Any, BlockBuilder]:
    ctx.check_model(req.model)
    tools = anthropic_tools_to_openai(req.tools)
    mode, name = resolve_anthropic_tool_choice(req.tool_choice, tools)
    effort, budget = thinking_effort(req)
    stops = normalize_stop(req.stop_sequences, "stop_sequences")
    prompt = chat_prompt(ctx, anthropic_messages(req), tools, mode, name, effort, budget)
    max_tokens = max_tokens_for(ctx, len(prompt.prompt_ids), req.max_tokens, "max_tokens")
    greq = generation_request(ctx, req, prompt.prompt_ids, max_tokens, stops,
                              prefill=prompt.prefill, reasoning_budget=prompt.reasoning_budget,
                              after_reasoning=prompt.after_reasoning,
                              hidden_token_ids=ctx.hidden_ids)
    return greq, BlockBuilder(tools or None, parse_calls=mode != "none")


async def messages(ctx: ServeContext, req: MessagesRequest) -> Any:
    """Returns a JSON-able dict, or an async iterator of SSE strings when streaming."""
    # Rendering and tokenizing take time in proportion to the prompt: not on the event loop.
    greq, builder = await asyncio.to_thread(_setup, ctx, req)
    mid = new_id("msg_")
    events = await start_generation(ctx, greq, mid, "messages")
    if req.stream:
        return _messages_sse(ctx, mid, events, builder, len(greq.prompt_ids))
    fin = None
    async for event in events:
        if isinstance(event, TextChunk):
            builder.feed(event.text)
        else:
            builder.feed("", final=True)
            fin = event
    assert fin is not None
    return _message(ctx, mid, builder.blocks, fin, builder.has_calls)


def _message(ctx: ServeContext, mid: str, blocks: list[dict[str, Any]], fin: Finished | None,
             has_calls: bool) -> dict[str, Any]:
    return {
        "id": mid, "type": "message", "role": "assistant", "model": ctx.model_name,
        "content": blocks,
        "stop_reason": None if fin is None else _stop_reason(fin, has_calls),
        "stop_sequence": None if fin is None else fin.stop_sequence,
        "usage": {"input_tokens": 0 if fin is None else fin.prompt_tokens,
                  "output_tokens": 0 if fin is None else fin.completion_tokens},
    }


async def _messages_sse(
    ctx: ServeContext, mid: str, events: AsyncIterator[TextChunk | Finished],
    builder: BlockBuilder, n_prompt: int,
) -> AsyncIterator[str]:
    start = _message(ctx, mid, [], None, False)
    start["usage"]["input_tokens"] = n_prompt
    yield sse({"type": "message_start", "message": start}, "message_start")
    try:
        async for event in events:
            final = isinstance(event, Finished)
            for name, data in builder.feed("" if final else event.text, final=final):
                yield sse(data, name)
            if isinstance(event, Finished):
                delta = {"stop_reason": _stop_reason(event, builder.has_calls),
                         "stop_sequence": event.stop_sequence}
                yield sse({"type": "message_delta", "delta": delta,
                           "usage": {"output_tokens": event.completion_tokens}}, "message_delta")
                yield sse({"type": "message_stop"}, "message_stop")
    except Exception as e:  # the stream has begun: report in-band, as Anthropic does
        yield sse(stream_error(e, mid).anthropic_body(), "error")
    finally:
        await events.aclose()  # type: ignore[attr-defined]
