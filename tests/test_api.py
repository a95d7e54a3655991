"""The HTTP API through the real openai and anthropic SDKs, over loopback, on a scripted engine.

The fake engine (tests/api_support.py) emits the tokens of a scripted Harmony response, so each
test knows exactly what reasoning, answer and tool calls the server must return.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from model.serve.http.app import create_app
from tests.api_support import (
    CALL_HEADER,
    FORCED_CLOSE_ANSWER,
    LONG,
    MODEL,
    PAST_STOP,
    PLAIN,
    RAMBLE,
    WEATHER,
    FakeEngine,
    demo_tokenizer,
    serve,
)

WEATHER_TOOL = {"type": "function", "function": {
    "name": "weather.lookup", "description": "Look up the weather",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "verbose": {"type": "boolean"}},
        "required": ["city"]}}}
CLOCK_TOOL = {"type": "function", "function": {
    "name": "clock", "parameters": {"type": "object", "properties": {"opts": {"type": "object"}}}}}
TOOLS = [WEATHER_TOOL, CLOCK_TOOL]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                   for t in TOOLS]
MAX_MODEL_LEN = 2048


@pytest.fixture(scope="module")
def tok():
    return demo_tokenizer()


@pytest.fixture(scope="module")
def fake(tok):
    return FakeEngine(tok)


@pytest.fixture(scope="module")
def port(fake, tok) -> Iterator[int]:
    with serve(create_app(fake, tok, MODEL, max_model_len=MAX_MODEL_LEN)) as p:
        yield p


@pytest.fixture(scope="module")
def oai(port):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0,
                         timeout=30)


@pytest.fixture(scope="module")
def claude(port):
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="x", max_retries=0,
                               timeout=30)


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def chat(oai, text: str, **kw: Any) -> Any:
    return oai.chat.completions.create(model=MODEL, messages=user(text), **kw)


def summarize(message: Any) -> dict[str, Any]:
    calls = [(c.function.name, json.loads(c.function.arguments))
             for c in (message.tool_calls or [])]
    return {"reasoning": getattr(message, "reasoning_content", None),
            "content": message.content, "calls": calls}


def stream_chat(oai, text: str, **kw: Any) -> tuple[dict[str, Any], str, Any]:
    """Stream a chat; returns the reassembled message summary, finish reason and usage."""
    reasoning, content, calls, finish, usage = [], [], {}, None, None
    for chunk in chat(oai, text, stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta
            reasoning.append(getattr(delta, "reasoning_content", None) or "")
            content.append(delta.content or "")
            for tc in delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                entry["name"] += (tc.function.name or "") if tc.function else ""
                entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = choice.finish_reason or finish
    joined = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    summary = {"reasoning": "".join(reasoning) or None,
               "content": "".join(content) if "".join(content) or not joined else None,
               "calls": joined}
    return summary, finish, usage


def n_tokens(tok, text: str) -> int:
    return len(tok.encode(text))


def test_models_and_health(oai, claude, port):
    assert [m.id for m in oai.models.list().data] == [MODEL]
    assert oai.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("other")
    assert [m.id for m in claude.models.list().data] == [MODEL]
    assert httpx.get(f"http://127.0.0.1:{port}/health").json() == {"status": "ok"}


def test_chat_separates_reasoning_and_counts_usage(oai, tok, fake):
    r = chat(oai, "[hello]")
    msg = r.choices[0].message
    assert (msg.reasoning_content, msg.content) == ("The user greets me.", "Hi! How are you?")
    assert msg.tool_calls is None and r.choices[0].finish_reason == "stop"
    prompt = fake.prompts[r.id]
    assert prompt.startswith("<|start|>system<|message|>Reasoning: max")
    assert r.usage.prompt_tokens == len(tok.encode(prompt))
    # Every scripted token through the stop token <|return|> is a generated token.
    assert r.usage.completion_tokens == n_tokens(tok, fake_script("[hello]"))
    assert r.usage.completion_tokens_details.reasoning_tokens == n_tokens(tok,
                                                                          "The user greets me.")


def fake_script(key: str) -> str:
    from tests.api_support import SCRIPTS

    return SCRIPTS[key]


@pytest.mark.parametrize("text,kw", [
    ("[hello]", {}),
    ("[weather]", {"tools": TOOLS}),
    ("[parallel]", {"tools": TOOLS}),
    ("[ramble]", {"reasoning_effort": "low"}),
    ("[stopword]", {"stop": ["STOP"]}),
    ("[notool]", {"tools": TOOLS,
                  "tool_choice": {"type": "function", "function": {"name": "weather.lookup"}}}),
    ("[long]", {"max_tokens": 7}),
])
def test_stream_equals_non_stream(oai, text, kw):
    r = chat(oai, text, **kw)
    streamed, finish, usage = stream_chat(oai, text, **kw)
    assert streamed == summarize(r.choices[0].message)
    assert finish == r.choices[0].finish_reason
    assert usage.model_dump() == r.usage.model_dump()


def test_tool_call_arguments_are_typed_by_schema(oai):
    r = chat(oai, "[weather]", tools=TOOLS)
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "weather.lookup"
    # "3" and "true" are integer and boolean in the schema: they arrive typed, not as strings.
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3, "verbose": True}
    assert r.choices[0].message.reasoning_content == "Need the forecast."


def test_parallel_tool_calls(oai):
    r = chat(oai, "[parallel]", tools=TOOLS)
    calls = summarize(r.choices[0].message)["calls"]
    assert calls == [("weather.lookup", {"city": "Paris"}), ("clock", {"opts": {"tz": "CET"}})]
    ids = [c.id for c in r.choices[0].message.tool_calls]
    assert len(set(ids)) == 2


def test_tool_choice_none_hides_tools_and_drops_calls(oai, fake):
    r = chat(oai, "[weather]", tools=TOOLS, tool_choice="none")
    assert "# Tools" not in fake.prompts[r.id]
    msg = r.choices[0].message
    assert msg.tool_calls is None and r.choices[0].finish_reason == "stop"
    assert msg.reasoning_content == "Need the forecast."
    r = chat(oai, "[weather]", tools=TOOLS)
    assert '"name": "weather.lookup"' in fake.prompts[r.id]


@pytest.mark.parametrize("effort", ["max", "none"])
def test_tool_choice_named_forces_the_call(oai, fake, effort):
    choice = {"type": "function", "function": {"name": "weather.lookup"}}
    r = chat(oai, "[notool]", tools=TOOLS, tool_choice=choice, reasoning_effort=effort)
    s = summarize(r.choices[0].message)
    assert s["calls"] == [("weather.lookup", {"city": "Paris", "days": 3, "verbose": True})]
    assert s["content"] is None and r.choices[0].finish_reason == "tool_calls"
    header = f"<|start|>assistant to=weather.lookup{CALL_HEADER}"
    if effort == "none":  # no reasoning: the call header is pre-filled in the prompt
        assert s["reasoning"] is None and fake.prompts[r.id].endswith(header)
    else:  # the model reasons; when it closes, the server writes the call header
        assert s["reasoning"] == "No tool is needed."
        assert fake.prompts[r.id].endswith("<|start|>assistant<|channel|>analysis<|message|>")
        assert fake.prompts[f"{r.id}.1"].endswith(f"No tool is needed.<|end|>{header}")
        assert r.id in fake.aborted  # the first engine request was cut at <|end|>


def test_tool_choice_named_survives_a_stop_token_in_the_reasoning(oai, fake):
    choice = {"type": "function", "function": {"name": "weather.lookup"}}
    r = chat(oai, "[stopthink]", tools=TOOLS, tool_choice=choice)
    s = summarize(r.choices[0].message)
    assert s["reasoning"] == "hmm" and s["calls"][0][0] == "weather.lookup"
    header = f"<|start|>assistant to=weather.lookup{CALL_HEADER}"
    assert fake.prompts[f"{r.id}.1"].endswith(f"hmm<|end|>{header}")


def test_tool_choice_required(oai, fake):
    r = chat(oai, "[notool]", tools=TOOLS, tool_choice="required")
    assert summarize(r.choices[0].message)["calls"] == [
        ("weather.lookup", {"city": "Paris", "days": 3, "verbose": True})]
    assert fake.prompts[f"{r.id}.1"].endswith("<|end|><|start|>assistant to=")


def test_reasoning_budget_force_closes_reasoning(oai, tok, fake):
    r = chat(oai, "[ramble]", reasoning_effort="low")  # budget 64 tokens (REASONING_BUDGET)
    header = tok.encode("<|channel|>analysis<|message|>")
    body = tok.encode(RAMBLE)[len(header):]
    msg = r.choices[0].message
    assert msg.reasoning_content == tok.decode(body[:64])
    assert msg.content == "Done thinking." and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens_details.reasoning_tokens == 64
    # Forced text is not generated: usage counts the header, 64 reasoning tokens and the answer.
    assert r.usage.completion_tokens == len(header) + 64 + n_tokens(tok, FORCED_CLOSE_ANSWER)
    assert fake.prompts[f"{r.id}.1"].endswith("<|end|><|start|>assistant")


def test_stop_token_ends_generation_even_if_engine_continues(oai, tok, fake):
    fake.honor_stop_ids = False
    try:
        r = chat(oai, "[paststop]")
    finally:
        fake.honor_stop_ids = True
    assert r.choices[0].message.content == "Hi! How are you?"
    assert r.choices[0].finish_reason == "stop"
    upto = PAST_STOP[: PAST_STOP.index("<|call|>") + len("<|call|>")]
    assert r.usage.completion_tokens == n_tokens(tok, upto)
    assert r.id in fake.aborted
    params = fake.params[r.id]
    assert set(tok.stop_token_ids) <= set(params.stop_token_ids)


def test_stop_strings_cut_the_answer(oai, fake):
    r = chat(oai, "[stopword]", stop=["STOP"])
    assert r.choices[0].message.content == "alpha beta "
    assert r.choices[0].finish_reason == "stop" and r.id in fake.aborted


def test_max_tokens_is_length(oai):
    r = chat(oai, "[long]", max_tokens=5)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5


def test_multi_turn_renders_history(oai, fake):
    messages = [
        {"role": "user", "content": "[weather]"},
        {"role": "assistant", "reasoning_content": "Need the forecast.", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "weather.lookup", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    ]
    r = oai.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
    prompt = fake.prompts[r.id]
    assert "<|start|>assistant to=weather.lookup" in prompt
    assert '<rfl:parameter name="city">\nParis\n</rfl:parameter><|call|>' in prompt
    assert prompt.endswith("<|start|>tool from=weather.lookup<|message|>18C<|end|>"
                           "<|start|>assistant")


def test_content_parts_and_developer_role(oai, fake):
    messages = [{"role": "developer", "content": "Answer briefly."},
                {"role": "user", "content": [{"type": "text", "text": "[hel"},
                                             {"type": "text", "text": "lo]"}]}]
    r = oai.chat.completions.create(model=MODEL, messages=messages)
    assert r.choices[0].message.content == "Hi! How are you?"
    assert "<|start|>developer<|message|>Answer briefly.<|end|>" in fake.prompts[r.id]


def test_completions(oai, tok, fake):
    r = oai.completions.create(model=MODEL, prompt="Hello", max_tokens=50)
    ids = tok.encode(PLAIN)
    assert r.choices[0].text == tok.decode(ids[:-1], skip_special_tokens=True)
    assert r.choices[0].finish_reason == "stop"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(tok.encode("Hello")),
                                                                   len(ids))
    raw = oai.completions.create(model=MODEL, prompt=tok.encode("Hello"), max_tokens=50,
                                 extra_body={"skip_special_tokens": False})
    assert raw.choices[0].text == PLAIN.removesuffix("<|return|>")
    streamed = "".join(c.choices[0].text for c in oai.completions.create(
        model=MODEL, prompt="Hello", max_tokens=50, stream=True) if c.choices)
    assert streamed == r.choices[0].text
    echoed = oai.completions.create(model=MODEL, prompt="Hello", max_tokens=3, echo=True)
    assert echoed.choices[0].text.startswith("Hello")
    assert echoed.choices[0].finish_reason == "length"


def test_chat_logprobs_stream_equals_non_stream(oai, tok):
    kw = {"logprobs": True, "top_logprobs": 2}
    r = chat(oai, "[hello]", **kw)
    entries = r.choices[0].logprobs.content
    ids = tok.encode(fake_script("[hello]"))
    assert len(entries) == r.usage.completion_tokens == len(ids)
    assert [e.token for e in entries] == [tok.decode([i]) for i in ids]
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
    streamed = [e for c in chat(oai, "[hello]", stream=True, **kw) for ch in c.choices
                if ch.logprobs for e in ch.logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in entries]
    assert chat(oai, "[hello]").choices[0].logprobs is None


def test_completion_logprobs(oai, tok):
    r = oai.completions.create(model=MODEL, prompt="Hello", max_tokens=50, logprobs=1)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert lp.text_offset == sorted(lp.text_offset) and all(len(t) == 1 for t in lp.top_logprobs)


# ---- Anthropic ------------------------------------------------------------------------------
def test_messages_thinking_and_text(claude, tok, fake):
    m = claude.messages.create(model=MODEL, max_tokens=100, messages=user("[hello]"),
                               system="Be brief.")
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == "The user greets me."
    assert m.content[1].text == "Hi! How are you?"
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    prompt = fake.prompts[m.id]
    assert "<|start|>system<|message|>Be brief.<|end|>" in prompt
    assert m.usage.input_tokens == len(tok.encode(prompt))
    assert m.usage.output_tokens == n_tokens(tok, fake_script("[hello]"))


def test_messages_tool_use(claude):
    m = claude.messages.create(model=MODEL, max_tokens=200, messages=user("[weather]"),
                               tools=ANTHROPIC_TOOLS)
    assert m.stop_reason == "tool_use"
    tool = m.content[-1]
    assert tool.type == "tool_use" and tool.id.startswith("toolu_")
    assert (tool.name, tool.input) == ("weather.lookup", {"city": "Paris", "days": 3,
                                                          "verbose": True})


@pytest.mark.parametrize("text,kw", [
    ("[hello]", {}),
    ("[parallel]", {"tools": ANTHROPIC_TOOLS}),
    ("[stopword]", {"stop_sequences": ["STOP"]}),
    ("[ramble]", {"thinking": {"type": "enabled", "budget_tokens": 10}}),
    ("[notool]", {"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool",
                                                           "name": "weather.lookup"}}),
    ("[long]", {"max_tokens": 6}),
])
def test_messages_stream_equals_non_stream(claude, text, kw):
    kw = {"max_tokens": 400, **kw}
    m = claude.messages.create(model=MODEL, messages=user(text), **kw)
    with claude.messages.stream(model=MODEL, messages=user(text), **kw) as stream:
        s = stream.get_final_message()

    def strip(msg: Any) -> list[dict[str, Any]]:
        return [{k: v for k, v in b.model_dump().items() if k != "id"} for b in msg.content]

    assert strip(s) == strip(m)
    assert (s.stop_reason, s.stop_sequence) == (m.stop_reason, m.stop_sequence)
    assert (s.usage.input_tokens, s.usage.output_tokens) == (m.usage.input_tokens,
                                                             m.usage.output_tokens)


def test_messages_stop_reasons(claude, tok):
    m = claude.messages.create(model=MODEL, max_tokens=100, messages=user("[stopword]"),
                               stop_sequences=["STOP"])
    assert (m.stop_reason, m.stop_sequence, m.content[-1].text) == ("stop_sequence", "STOP",
                                                                    "alpha beta ")
    m = claude.messages.create(model=MODEL, max_tokens=6, messages=user("[long]"))
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 6
    m = claude.messages.create(model=MODEL, max_tokens=400, messages=user("[ramble]"),
                               thinking={"type": "enabled", "budget_tokens": 10})
    body = tok.encode(RAMBLE)[len(tok.encode("<|channel|>analysis<|message|>")):]
    assert m.content[0].thinking == tok.decode(body[:10])
    assert m.content[1].text == "Done thinking."


def test_messages_thinking_disabled(claude, fake):
    m = claude.messages.create(model=MODEL, max_tokens=100, messages=user("[hello]"),
                               thinking={"type": "disabled"})
    assert fake.prompts[m.id].startswith("<|start|>system<|message|>Reasoning: none")


def test_messages_multi_turn_with_tool_result(claude, fake):
    messages = [
        {"role": "user", "content": "[weather]"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Need the forecast.", "signature": ""},
            {"type": "tool_use", "id": "toolu_1", "name": "weather.lookup",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"},
            {"type": "text", "text": "Thanks"}]},
    ]
    m = claude.messages.create(model=MODEL, max_tokens=100, messages=messages,
                               tools=ANTHROPIC_TOOLS)
    prompt = fake.prompts[m.id]
    assert "<|start|>assistant<|channel|>analysis<|message|>Need the forecast.<|end|>" in prompt
    assert ("<|start|>tool from=weather.lookup<|message|>18C<|end|>"
            "<|start|>user<|message|>Thanks<|end|><|start|>assistant") in prompt


def test_messages_raw_event_order(port):
    body = {"model": MODEL, "max_tokens": 200, "stream": True, "messages": user("[weather]"),
            "tools": ANTHROPIC_TOOLS}
    with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/messages", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    order = [e for i, e in enumerate(events) if i == 0 or e != events[i - 1]]
    assert order == ["message_start", "content_block_start", "content_block_delta",
                     "content_block_stop", "content_block_start", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]


def test_script_sanity(tok):
    # The scripts above must tokenize with their special tokens whole, or the tests mean little.
    for script in (WEATHER, LONG):
        assert tok.decode(tok.encode(script)) == script
