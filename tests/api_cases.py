"""Bad requests for both APIs, shared by the per-case tests (tests/test_api_errors.py) and the
test that sends them all to one real-engine server in a row (tests/test_api_battery.py).

Each must be answered with a 4xx JSON error in the shape of the API it called. Servers that run
these use MAX_MODEL_LEN and serve MODEL.
"""

from __future__ import annotations

import json
from typing import Any

from tests.api_support import MODEL

MAX_MODEL_LEN = 512
JSON = {"content-type": "application/json"}
GOOD_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "[hello]"}]}
GOOD_MESSAGES = {"model": MODEL, "max_tokens": 64,
                 "messages": [{"role": "user", "content": "[hello]"}]}
HUGE = 2**63  # one past int64


def with_(body: dict[str, Any], **changes: Any) -> bytes:
    return json.dumps({**body, **changes}).encode()


def raw_json_with(body: dict[str, Any], key: str, literal: str) -> bytes:
    """`body` with `key` set to a literal JSON cannot encode (NaN, Infinity)."""
    text = json.dumps({**body, key: "__X__"})
    return text.replace('"__X__"', literal).encode()


def _assistant_call(**call: Any) -> list[dict[str, Any]]:
    fn = {"name": "f", "arguments": "{}", **call.pop("function", {})}
    return [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                   "function": fn, **call}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
            {"role": "user", "content": "[hello]"}]


def _fn_tool(**fn: Any) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "f", **fn}}]


LONG_PROMPT = [{"role": "user", "content": "word " * 2 * MAX_MODEL_LEN}]
NESTED_BAD_SCHEMA = {"type": "object", "properties": {"x": {"type": "strang"}}}

# name -> (body, status, OpenAI `param` expected, None: any)
BAD_CHAT: dict[str, tuple[bytes, int, str | None]] = {
    "malformed json": (b'{"model": "beam-test", "messages": [', 400, None),
    "empty body": (b"", 400, None),
    "not an object": (b"[1, 2]", 400, None),
    "unknown model": (with_(GOOD_CHAT, model="gpt-9"), 404, "model"),
    "negative max_tokens": (with_(GOOD_CHAT, max_tokens=-5), 400, "max_tokens"),
    "zero max_completion_tokens": (with_(GOOD_CHAT, max_completion_tokens=0), 400,
                                   "max_completion_tokens"),
    "huge max_tokens": (with_(GOOD_CHAT, max_tokens=10**30), 400, "max_tokens"),
    "prompt too long": (with_(GOOD_CHAT, messages=LONG_PROMPT), 400, "messages"),
    "schema not an object": (with_(GOOD_CHAT, tools=_fn_tool(parameters={"type": "string"})),
                             400, "tools[0].function.parameters"),
    "schema invalid below its top": (with_(GOOD_CHAT, tools=_fn_tool(
        parameters=NESTED_BAD_SCHEMA)), 400, "tools[0].function.parameters"),
    "schema required not a list": (with_(GOOD_CHAT, tools=_fn_tool(parameters={
        "type": "object", "properties": {}, "required": "x"})), 400,
        "tools[0].function.parameters"),
    "tool description a number": (with_(GOOD_CHAT, tools=_fn_tool(description=5)), 400,
                                   "tools[0].function.description"),
    "tool name with space": (with_(GOOD_CHAT, tools=_fn_tool(name="my tool")), 400,
                             "tools[0].function.name"),
    "tool not a function": (with_(GOOD_CHAT, tools=[{"type": "retrieval"}]), 400, "tools[0]"),
    "temperature string": (with_(GOOD_CHAT, temperature="hot"), 400, "temperature"),
    "temperature numeric string": (with_(GOOD_CHAT, temperature="0.5"), 400, "temperature"),
    "temperature NaN": (raw_json_with(GOOD_CHAT, "temperature", "NaN"), 400, "temperature"),
    "temperature infinite": (raw_json_with(GOOD_CHAT, "temperature", "Infinity"), 400,
                             "temperature"),
    "temperature above 100": (with_(GOOD_CHAT, temperature=1e300), 400, "temperature"),
    "negative temperature": (with_(GOOD_CHAT, temperature=-1e-45), 400, "temperature"),
    "top_k 2**63": (with_(GOOD_CHAT, top_k=HUGE), 400, "top_k"),
    "top_k above the vocabulary": (with_(GOOD_CHAT, top_k=10**6), 400, "top_k"),
    "top_k below -1": (with_(GOOD_CHAT, top_k=-2), 400, "top_k"),
    "seed 2**64": (with_(GOOD_CHAT, seed=2**64), 400, "seed"),
    "seed below int64": (with_(GOOD_CHAT, seed=-(2**63) - 1), 400, "seed"),
    "top_p NaN": (raw_json_with(GOOD_CHAT, "top_p", "NaN"), 400, "top_p"),
    "min_p above 1": (with_(GOOD_CHAT, min_p=1.5), 400, "min_p"),
    "top_logprobs 21": (with_(GOOD_CHAT, logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    "max_tokens float": (with_(GOOD_CHAT, max_tokens=1.5), 400, "max_tokens"),
    "stream not bool": (with_(GOOD_CHAT, stream="yes"), 400, "stream"),
    "top_p zero": (with_(GOOD_CHAT, top_p=0), 400, "top_p"),
    "17 stop strings": (with_(GOOD_CHAT, stop=[f"s{i}" for i in range(17)]), 400, "stop"),
    "stop string too long": (with_(GOOD_CHAT, stop=["x" * 5000]), 400, "stop"),
    "empty stop string": (with_(GOOD_CHAT, stop=[""]), 400, "stop"),
    "stop not a string": (with_(GOOD_CHAT, stop=[1]), 400, "stop[0]"),
    "messages empty": (with_(GOOD_CHAT, messages=[]), 400, "messages"),
    "message not object": (with_(GOOD_CHAT, messages=["hi"]), 400, "messages[0]"),
    "unknown role": (with_(GOOD_CHAT, messages=[{"role": "robot", "content": "x"}]), 400,
                     "messages[0].role"),
    "content a number": (with_(GOOD_CHAT, messages=[{"role": "user", "content": 5}]), 400,
                         "messages[0].content"),
    "text part whose text is a number": (with_(GOOD_CHAT, messages=[{"role": "user", "content": [
        {"type": "text", "text": 5}]}]), 400, "messages[0].content[0].text"),
    "content part not an object": (with_(GOOD_CHAT, messages=[{"role": "user", "content": [
        "hi"]}]), 400, "messages[0].content[0]"),
    "reasoning_content a number": (with_(GOOD_CHAT, messages=[
        {"role": "assistant", "content": "a", "reasoning_content": 7},
        {"role": "user", "content": "[hello]"}]), 400, "messages[0].reasoning_content"),
    "tool_choice unknown tool": (with_(GOOD_CHAT, tools=_fn_tool(), tool_choice={
        "type": "function", "function": {"name": "g"}}), 400, "tool_choice"),
    "tool_choice without tools": (with_(GOOD_CHAT, tool_choice="required"), 400, "tool_choice"),
    "bad reasoning_effort": (with_(GOOD_CHAT, reasoning_effort="extreme"), 400,
                             "reasoning_effort"),
    "n=2": (with_(GOOD_CHAT, n=2), 400, "n"),
    "n beyond int64": (with_(GOOD_CHAT, n=10**20), 400, "n"),
    "image part": (with_(GOOD_CHAT, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400,
        "messages[0].content[0]"),
    "stop token id out of vocab": (with_(GOOD_CHAT, stop_token_ids=[10**7]), 400,
                                   "stop_token_ids"),
    "stop token id beyond int64": (with_(GOOD_CHAT, stop_token_ids=[2**70]), 400,
                                   "stop_token_ids"),
    "tool call arguments not json": (with_(GOOD_CHAT, messages=_assistant_call(
        function={"arguments": "{oops"})), 400, "messages[0].tool_calls[0].function.arguments"),
    "tool call arguments a JSON array": (with_(GOOD_CHAT, messages=_assistant_call(
        function={"arguments": "[1, 2]"})), 400,
        "messages[0].tool_calls[0].function.arguments"),
    "tool call id an object": (with_(GOOD_CHAT, messages=_assistant_call(id={"a": 1})), 400,
                               "messages[0].tool_calls[0].id"),
    "tool call name a number": (with_(GOOD_CHAT, messages=_assistant_call(
        function={"name": 3})), 400, "messages[0].tool_calls[0].function.name"),
}

# (body, expected `param` prefix)
BAD_COMPLETIONS: list[tuple[dict[str, Any], str]] = [
    ({"model": MODEL, "prompt": [5, 10**7]}, "prompt"),
    ({"model": MODEL, "prompt": [5, -1]}, "prompt"),
    ({"model": MODEL, "prompt": [5, 2**70]}, "prompt"),
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL, "prompt": ["a", "b"]}, "prompt"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ({"model": MODEL, "prompt": {"text": "hi"}}, "prompt"),
    ({"model": MODEL, "prompt": "hi", "seed": 2**64}, "seed"),
    ({"model": MODEL, "prompt": "hi", "top_k": HUGE}, "top_k"),
    ({"model": MODEL, "prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"model": MODEL, "prompt": "hi", "stop": ["x"] * 17}, "stop"),
]


def _blocks(*blocks: dict[str, Any], role: str = "user") -> list[dict[str, Any]]:
    msgs = [{"role": role, "content": list(blocks)}]
    return msgs if role == "user" else [{"role": "user", "content": "hi"}, *msgs,
                                        {"role": "user", "content": "[hello]"}]


# name -> (body, status, Anthropic error type)
BAD_MESSAGES: dict[str, tuple[bytes, int, str]] = {
    "malformed json": (b'{"model": ', 400, "invalid_request_error"),
    "missing max_tokens": (json.dumps({"model": MODEL, "messages": GOOD_MESSAGES["messages"]})
                           .encode(), 400, "invalid_request_error"),
    "negative max_tokens": (with_(GOOD_MESSAGES, max_tokens=-1), 400, "invalid_request_error"),
    "huge max_tokens": (with_(GOOD_MESSAGES, max_tokens=10**6), 400, "invalid_request_error"),
    "unknown model": (with_(GOOD_MESSAGES, model="claude-x"), 404, "not_found_error"),
    "prompt too long": (with_(GOOD_MESSAGES, messages=LONG_PROMPT), 400, "invalid_request_error"),
    "tool without schema": (with_(GOOD_MESSAGES, tools=[{"name": "f"}]), 400,
                            "invalid_request_error"),
    "schema not an object": (with_(GOOD_MESSAGES, tools=[{"name": "f", "input_schema": {
        "type": "array"}}]), 400, "invalid_request_error"),
    "schema invalid below its top": (with_(GOOD_MESSAGES, tools=[{
        "name": "f", "input_schema": NESTED_BAD_SCHEMA}]), 400, "invalid_request_error"),
    "bad thinking": (with_(GOOD_MESSAGES, thinking={"type": "enabled"}), 400,
                     "invalid_request_error"),
    "thinking budget a string": (with_(GOOD_MESSAGES, thinking={
        "type": "enabled", "budget_tokens": "5"}), 400, "invalid_request_error"),
    "image block": (with_(GOOD_MESSAGES, messages=_blocks({"type": "image", "source": {}})), 400,
                    "invalid_request_error"),
    "bad role": (with_(GOOD_MESSAGES, messages=[{"role": "system", "content": "x"}]), 400,
                 "invalid_request_error"),
    "content a number": (with_(GOOD_MESSAGES, messages=[{"role": "user", "content": 5}]), 400,
                         "invalid_request_error"),
    "block not an object": (with_(GOOD_MESSAGES, messages=_blocks("hi")), 400,
                            "invalid_request_error"),
    "text block whose text is a number": (with_(GOOD_MESSAGES, messages=_blocks(
        {"type": "text", "text": 5})), 400, "invalid_request_error"),
    "system block whose text is a number": (with_(GOOD_MESSAGES, system=[
        {"type": "text", "text": 5}]), 400, "invalid_request_error"),
    "system a number": (with_(GOOD_MESSAGES, system=5), 400, "invalid_request_error"),
    "tool_result with numeric content": (with_(GOOD_MESSAGES, messages=_blocks(
        {"type": "tool_result", "tool_use_id": "t1", "content": 5})), 400,
        "invalid_request_error"),
    "tool_result with a numeric block": (with_(GOOD_MESSAGES, messages=_blocks(
        {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": 5}]})),
        400, "invalid_request_error"),
    "tool_use whose id is an object": (with_(GOOD_MESSAGES, messages=_blocks(
        {"type": "tool_use", "id": {"a": 1}, "name": "f", "input": {}}, role="assistant")), 400,
        "invalid_request_error"),
    "tool_use whose input is a list": (with_(GOOD_MESSAGES, messages=_blocks(
        {"type": "tool_use", "id": "t1", "name": "f", "input": [1]}, role="assistant")), 400,
        "invalid_request_error"),
    "thinking block from the user": (with_(GOOD_MESSAGES, messages=_blocks(
        {"type": "thinking", "thinking": "x"})), 400, "invalid_request_error"),
    "unknown block type": (with_(GOOD_MESSAGES, messages=_blocks({"type": "document"})), 400,
                           "invalid_request_error"),
    "temperature string": (with_(GOOD_MESSAGES, temperature="warm"), 400,
                           "invalid_request_error"),
    "temperature NaN": (raw_json_with(GOOD_MESSAGES, "temperature", "NaN"), 400,
                        "invalid_request_error"),
    "top_k 2**63": (with_(GOOD_MESSAGES, top_k=HUGE), 400, "invalid_request_error"),
    "top_k above the vocabulary": (with_(GOOD_MESSAGES, top_k=10**6), 400,
                                   "invalid_request_error"),
    "seed 2**64": (with_(GOOD_MESSAGES, seed=2**64), 400, "invalid_request_error"),
    "1,000 stop_sequences": (with_(GOOD_MESSAGES, stop_sequences=[f"s{i}" for i in range(1000)]),
                             400, "invalid_request_error"),
    "20,000 stop_sequences": (with_(GOOD_MESSAGES, stop_sequences=["s"] * 20000), 400,
                              "invalid_request_error"),
    "stop sequence too long": (with_(GOOD_MESSAGES, stop_sequences=["x" * 5000]), 400,
                               "invalid_request_error"),
    "empty stop sequence": (with_(GOOD_MESSAGES, stop_sequences=[""]), 400,
                            "invalid_request_error"),
    "bad tool_choice": (with_(GOOD_MESSAGES, tool_choice={"type": "sometimes"}), 400,
                        "invalid_request_error"),
}

# Bodies that are not JSON requests: (path, body, headers) -> 415 in the path's API shape.
NOT_JSON: dict[str, tuple[str, bytes, dict[str, str]]] = {
    "chat as text/plain": ("/v1/chat/completions", with_(GOOD_CHAT),
                           {"content-type": "text/plain"}),
    "chat without a content type": ("/v1/chat/completions", with_(GOOD_CHAT), {}),
    "completion as a form": ("/v1/completions", b"model=beam-test&prompt=hi",
                             {"content-type": "application/x-www-form-urlencoded"}),
    "messages as text/plain": ("/v1/messages", with_(GOOD_MESSAGES),
                               {"content-type": "text/plain;charset=UTF-8"}),
    "messages as multipart": ("/v1/messages", b"--x\r\n\r\n--x--",
                              {"content-type": "multipart/form-data; boundary=x"}),
}
