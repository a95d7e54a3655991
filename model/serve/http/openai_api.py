"""OpenAI-compatible `/v1/chat/completions` and `/v1/completions` (JSON and SSE streams).

Streaming and non-streaming responses run the same `StreamingParser` over the same generated
text, so they split reasoning, answer and tool calls identically: a non-streaming message is the
concatenation of the streamed deltas.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from model.serve.engine.generation import Finished, TextChunk
from model.serve.harmony import Delta, StreamingParser
from model.serve.http.content import openai_messages
from model.serve.http.errors import APIError
from model.serve.http.protocol import ChatCompletionRequest, CompletionRequest, normalize_stop
from model.serve.http.serving import (
    ServeContext,
    chat_prompt,
    check_token_ids,
    generation_request,
    max_tokens_for,
    new_id,
    reasoning_effort,
    start_generation,
)
from model.serve.http.sse import sse, stream_error
from model.serve.http.tools import resolve_tool_choice, validate_openai_tools


def _usage(fin: Finished, reasoning: bool) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": fin.prompt_tokens,
        "completion_tokens": fin.completion_tokens,
        "total_tokens": fin.prompt_tokens + fin.completion_tokens,
    }
    if reasoning:
        usage["completion_tokens_details"] = {"reasoning_tokens": fin.reasoning_tokens}
    return usage


def _finish_reason(fin: Finished, has_calls: bool) -> str:
    if fin.reason == "stop" and has_calls:
        return "tool_calls"
    return fin.reason


def _token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id]) if token_id < tokenizer.vocab_size else ""


def chat_logprobs(tokenizer: Any, chunk: TextChunk) -> list[dict[str, Any]]:
    """OpenAI chat `logprobs.content` entries of the tokens in `chunk` (engine TokenLogprobs)."""
    def entry(t: int, v: float) -> dict[str, Any]:
        text = _token_text(tokenizer, t)
        return {"token": text, "logprob": v, "bytes": list(text.encode())}

    return [{**entry(tid, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for tid, lp in zip(chunk.token_ids, chunk.logprobs or [])]


class CompletionLogprobs:
    """The legacy completions `logprobs` object, built token by token."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.offset = 0

    def of(self, chunk: TextChunk) -> dict[str, Any] | None:
        if not chunk.logprobs:
            return None
        body: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                      "text_offset": []}
        for tid, lp in zip(chunk.token_ids, chunk.logprobs):
            text = _token_text(self.tokenizer, tid)
            body["tokens"].append(text)
            body["token_logprobs"].append(lp.logprob)
            body["top_logprobs"].append({_token_text(self.tokenizer, t): v for t, v in lp.top})
            body["text_offset"].append(self.offset)
            self.offset += len(text)
        return body


def merge_logprobs(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not parts:
        return None
    return {k: [x for p in parts for x in p[k]] for k in parts[0]}


class ChatStream:
    """Harmony deltas -> OpenAI message deltas; also accumulates the whole message."""

    def __init__(self, tools: list[dict[str, Any]] | None, parse_calls: bool) -> None:
        self.parser = StreamingParser(tools)
        self.parse_calls = parse_calls
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: list[dict[str, Any]] = []
        self.logprobs: list[dict[str, Any]] | None = None  # set when the request asks for them

    def feed(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        deltas = self.parser.feed(text)
        if final:
            deltas += self.parser.finish()
        return [d for d in (self._delta(x) for x in deltas) if d is not None]

    def _delta(self, d: Delta) -> dict[str, Any] | None:
        if d.kind == "reasoning":
            self.reasoning.append(d.text)
            return {"reasoning_content": d.text}
        if d.kind == "content":
            self.content.append(d.text)
            return {"content": d.text}
        if not self.parse_calls:
            return None
        if d.kind == "tool_call_start":
            call = {"id": new_id("call_"), "type": "function",
                    "function": {"name": d.name, "arguments": ""}}
            self.calls.append(call)
            return {"tool_calls": [{"index": d.index, "id": call["id"], "type": "function",
                                    "function": {"name": d.name, "arguments": ""}}]}
        self.calls[d.index]["function"]["arguments"] = d.arguments
        return {"tool_calls": [{"index": d.index, "function": {"arguments": d.arguments}}]}

    def message(self) -> dict[str, Any]:
        content = "".join(self.content)
        msg: dict[str, Any] = {
            "role": "assistant",
            "content": content if content or not self.calls else None,
            "reasoning_content": "".join(self.reasoning) or None,
        }
        if self.calls:
            msg["tool_calls"] = self.calls
        return msg


def _chat_setup(ctx: ServeContext, req: ChatCompletionRequest) -> tuple[Any, ChatStream]:
    ctx.check_model(req.model)
    if req.n != 1:
        raise APIError(400, f"'n' must be 1 (this server returns one choice), got {req.n}",
                       param="n")
    tools = validate_openai_tools(req.tools)
    mode, name = resolve_tool_choice(req.tool_choice, tools)
    effort = reasoning_effort(req.reasoning_effort)
    prompt = chat_prompt(ctx, openai_messages(req.messages), tools, mode, name, effort)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None \
        else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = max_tokens_for(ctx, len(prompt.prompt_ids), requested, param)
    greq = generation_request(
        ctx, req, prompt.prompt_ids, max_tokens, normalize_stop(req.stop),
        prefill=prompt.prefill, reasoning_budget=prompt.reasoning_budget,
        after_reasoning=prompt.after_reasoning, hidden_token_ids=ctx.hidden_ids,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
    )
    return greq, ChatStream(tools or None, parse_calls=mode != "none")


async def chat_completions(ctx: ServeContext, req: ChatCompletionRequest) -> Any:
    """Returns a JSON-able dict, or an async iterator of SSE strings when streaming."""
    # Rendering and tokenizing take time in proportion to the prompt: not on the event loop.
    greq, stream = await asyncio.to_thread(_chat_setup, ctx, req)
    rid = new_id("chatcmpl-")
    events = await start_generation(ctx, greq, rid, "chat")
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _chat_sse(ctx, rid, events, stream, include_usage)
    fin, logprobs = None, []
    async for event in events:
        if isinstance(event, TextChunk):
            stream.feed(event.text)
            logprobs += chat_logprobs(ctx.tokenizer, event)
        else:
            stream.feed("", final=True)
            fin = event
    assert fin is not None
    return {
        "id": rid, "object": "chat.completion", "created": ctx.created, "model": ctx.model_name,
        "choices": [{"index": 0, "message": stream.message(),
                     "logprobs": {"content": logprobs} if req.logprobs else None,
                     "finish_reason": _finish_reason(fin, bool(stream.calls))}],
        "usage": _usage(fin, reasoning=True),
    }


async def _chat_sse(
    ctx: ServeContext, rid: str, events: AsyncIterator[TextChunk | Finished], stream: ChatStream,
    include_usage: bool,
) -> AsyncIterator[str]:
    def chunk(delta: dict[str, Any], finish: str | None = None,
              logprobs: list[dict[str, Any]] | None = None) -> str:
        return sse({"id": rid, "object": "chat.completion.chunk", "created": ctx.created,
                    "model": ctx.model_name,
                    "choices": [{"index": 0, "delta": delta,
                                 "logprobs": {"content": logprobs} if logprobs else None,
                                 "finish_reason": finish}]})

    yield chunk({"role": "assistant", "content": ""})
    try:
        async for event in events:
            final = isinstance(event, Finished)
            deltas = stream.feed("" if final else event.text, final=final)
            # A token's logprobs ride on the first delta its text produced (or an empty one).
            logprobs = [] if final else chat_logprobs(ctx.tokenizer, event)
            if logprobs and not deltas:
                deltas = [{}]
            for i, delta in enumerate(deltas):
                yield chunk(delta, logprobs=logprobs if i == 0 else None)
            if isinstance(event, Finished):
                yield chunk({}, _finish_reason(event, bool(stream.calls)))
                if include_usage:
                    yield sse({"id": rid, "object": "chat.completion.chunk",
                               "created": ctx.created, "model": ctx.model_name, "choices": [],
                               "usage": _usage(event, reasoning=True)})
    except Exception as e:  # the stream has begun: report in-band, as OpenAI does
        yield sse(stream_error(e, rid).openai_body())
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    yield sse("[DONE]")


def _completion_prompt(ctx: ServeContext, req: CompletionRequest) -> list[int]:
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise APIError(400, f"'prompt' holds {len(prompt)} prompts; send one per request",
                           param="prompt")
        prompt = prompt[0]  # type: ignore[assignment]
    if isinstance(prompt, str):
        return ctx.encode(prompt, "prompt")
    ids = list(prompt)  # type: ignore[arg-type]
    check_token_ids(ctx, ids, "prompt")
    return ids


def _completion_setup(ctx: ServeContext, req: CompletionRequest) -> tuple[Any, str]:
    ctx.check_model(req.model)
    if req.n != 1:
        raise APIError(400, f"'n' must be 1 (this server returns one choice), got {req.n}",
                       param="n")
    ids = _completion_prompt(ctx, req)
    max_tokens = max_tokens_for(ctx, len(ids), req.max_tokens, "max_tokens")
    greq = generation_request(ctx, req, ids, max_tokens, normalize_stop(req.stop),
                              skip_special_tokens=req.skip_special_tokens, logprobs=req.logprobs)
    echo = ctx.tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens) \
        if req.echo else ""
    return greq, echo


async def completions(ctx: ServeContext, req: CompletionRequest) -> Any:
    greq, echo = await asyncio.to_thread(_completion_setup, ctx, req)
    rid = new_id("cmpl-")
    events = await start_generation(ctx, greq, rid, "completions")
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _completion_sse(ctx, rid, events, echo, include_usage)
    text, fin, lps, parts = [echo], None, CompletionLogprobs(ctx.tokenizer), []
    lps.offset = len(echo)
    async for event in events:
        if isinstance(event, TextChunk):
            text.append(event.text)
            parts.append(lps.of(event))
        else:
            fin = event
    assert fin is not None
    return {
        "id": rid, "object": "text_completion", "created": ctx.created, "model": ctx.model_name,
        "choices": [{"index": 0, "text": "".join(text),
                     "logprobs": merge_logprobs([p for p in parts if p]),
                     "finish_reason": fin.reason}],
        "usage": _usage(fin, reasoning=False),
    }


async def _completion_sse(
    ctx: ServeContext, rid: str, events: AsyncIterator[TextChunk | Finished], echo: str,
    include_usage: bool,
) -> AsyncIterator[str]:
    def chunk(text: str, finish: str | None = None, logprobs: Any = None) -> str:
        return sse({"id": rid, "object": "text_completion", "created": ctx.created,
                    "model": ctx.model_name,
                    "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                                 "finish_reason": finish}]})

    lps = CompletionLogprobs(ctx.tokenizer)
    lps.offset = len(echo)
    try:
        if echo:
            yield chunk(echo)
        async for event in events:
            if isinstance(event, TextChunk):
                logprobs = lps.of(event)
                if event.text or logprobs:
                    yield chunk(event.text, logprobs=logprobs)
                continue
            yield chunk("", event.reason)
            if include_usage:
                yield sse({"id": rid, "object": "text_completion", "created": ctx.created,
                           "model": ctx.model_name, "choices": [],
                           "usage": _usage(event, reasoning=False)})
    except Exception as e:
        yield sse(stream_error(e, rid).openai_body())
    finally:
        await events.aclose()  # type: ignore[attr-defined]
    yield sse("[DONE]")
