"""Bad input, auth, disconnects, load and metrics of the HTTP API (scripted engine, loopback).

Every bad request must get a 4xx JSON error in the shape of the API it called, and the server
must keep serving afterwards.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from model.serve.http.app import create_app
from tests.api_cases import (
    BAD_CHAT,
    BAD_COMPLETIONS,
    BAD_MESSAGES,
    GOOD_CHAT,
    GOOD_MESSAGES,
    JSON,
    MAX_MODEL_LEN,
    NOT_JSON,
)
from tests.api_support import (
    MODEL,
    VOCAB,
    FakeEngine,
    demo_tokenizer,
    metric,
    scrape,
    serve,
    server_errors,
)

KEY = "sekret-key"


@pytest.fixture(scope="module")
def fake():
    return FakeEngine(demo_tokenizer())


@pytest.fixture(scope="module")
def base(fake) -> Iterator[str]:
    with serve(create_app(fake, demo_tokenizer(), MODEL, max_model_len=MAX_MODEL_LEN)) as port:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def slow() -> Iterator[tuple[str, FakeEngine]]:
    """A server whose engine takes 5 ms a token, so clients can overlap and hang up mid-stream."""
    engine = FakeEngine(demo_tokenizer(), delay=0.005)
    with serve(create_app(engine, demo_tokenizer(), MODEL, max_model_len=4096)) as port:
        yield f"http://127.0.0.1:{port}", engine


def assert_openai_error(r: httpx.Response, status: int, param: str | None) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"] and isinstance(body["error"]["type"], str)
    if param is not None:
        assert body["error"]["param"] == param, body


def assert_anthropic_error(r: httpx.Response, status: int, kind: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == kind and body["error"]["message"]


def assert_still_serving(base: str) -> None:
    r = httpx.post(f"{base}/v1/chat/completions", json=GOOD_CHAT, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == \
        "Hi! How are you?"


@pytest.mark.parametrize("case", list(NOT_JSON))
def test_bodies_that_are_not_json_are_refused(base, fake, case):
    path, body, headers = NOT_JSON[case]
    before = len(fake.prompts)
    r = httpx.post(f"{base}{path}", content=body, headers=headers, timeout=30)
    if path == "/v1/messages":
        assert_anthropic_error(r, 415, "invalid_request_error")
    else:
        assert_openai_error(r, 415, None)
    assert "application/json" in r.text and len(fake.prompts) == before


@pytest.mark.parametrize("case", list(BAD_CHAT))
def test_bad_chat_requests(base, case):
    body, status, param = BAD_CHAT[case]
    r = httpx.post(f"{base}/v1/chat/completions", content=body, headers=JSON, timeout=30)
    assert_openai_error(r, status, param)
    assert_still_serving(base)


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS)
def test_bad_completion_requests(base, body, param):
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
    assert_openai_error(r, 400, None)
    assert r.json()["error"]["param"].startswith(param), r.text


@pytest.mark.parametrize("case", list(BAD_MESSAGES))
def test_bad_messages_requests(base, case):
    body, status, kind = BAD_MESSAGES[case]
    r = httpx.post(f"{base}/v1/messages", content=body, timeout=30, headers=JSON)
    assert_anthropic_error(r, status, kind)
    assert_still_serving(base)


@pytest.mark.parametrize("temperature,sent", [
    (1e-45, 0.0),  # below the greedy floor: greedy, as vLLM does
    (9e-6, 0.0),
    (5e-3, 0.01),  # small but above it: raised to the floor, so logits / T stays finite
    (0.7, 0.7),
])
def test_tiny_temperatures_are_greedy(base, fake, temperature, sent):
    oai = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    r = oai.chat.completions.create(model=MODEL, messages=GOOD_CHAT["messages"],
                                    temperature=temperature)
    assert r.choices[0].message.content == "Hi! How are you?"
    assert fake.params[r.id].temperature == sent
    claude = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
    m = claude.messages.create(model=MODEL, max_tokens=64, messages=GOOD_MESSAGES["messages"],
                               extra_body={"temperature": temperature})
    assert fake.params[m.id].temperature == sent


def test_numeric_limits_that_are_accepted(base, fake):
    """The ends of every range are served: seeds at both ends of int64, top_k = vocabulary."""
    oai = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    for seed in (-(2**63), 2**63 - 1, 0):
        r = oai.chat.completions.create(model=MODEL, messages=GOOD_CHAT["messages"], seed=seed,
                                        temperature=0.8, extra_body={"top_k": VOCAB})
        assert r.choices[0].message.content == "Hi! How are you?"
        assert fake.params[r.id].seed == seed and fake.params[r.id].top_k == VOCAB
    r = oai.chat.completions.create(model=MODEL, messages=GOOD_CHAT["messages"],
                                    stop=[f"s{i}" for i in range(16)])
    assert r.choices[0].finish_reason == "stop"
    claude = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
    m = claude.messages.create(model=MODEL, max_tokens=64, messages=GOOD_MESSAGES["messages"],
                               stop_sequences=[f"s{i}" for i in range(16)],
                               extra_body={"seed": -(2**63), "top_k": -1})
    assert m.content[-1].text == "Hi! How are you?"


def test_sdk_errors(base):
    oai = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="nope", messages=GOOD_CHAT["messages"])
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=MODEL, messages=GOOD_CHAT["messages"], max_tokens=-1)
    claude = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="nope", max_tokens=5, messages=GOOD_MESSAGES["messages"])
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=MODEL, max_tokens=5000, messages=GOOD_MESSAGES["messages"])


def test_error_messages_do_not_echo_huge_values(base):
    for path, body in (("/v1/chat/completions", {**GOOD_CHAT, "model": "x" * 100_000}),
                       ("/v1/messages", {**GOOD_MESSAGES, "model": "x" * 100_000}),
                       ("/v1/chat/completions", {**GOOD_CHAT, "reasoning_effort": "y" * 100_000}),
                       ("/v1/chat/completions", {**GOOD_CHAT, "temperature": "z" * 100_000})):
        r = httpx.post(f"{base}{path}", json=body, timeout=30)
        assert 400 <= r.status_code < 500 and len(r.content) < 1000, r.text[:200]


def test_unknown_route_and_method(base):
    assert_openai_error(httpx.get(f"{base}/v1/nothing"), 404, None)
    assert_openai_error(httpx.get(f"{base}/v1/chat/completions"), 405, None)
    assert_anthropic_error(httpx.get(f"{base}/v1/messages"), 405, "invalid_request_error")


def test_api_key(fake):
    with serve(create_app(fake, demo_tokenizer(), MODEL, api_key=KEY,
                          max_model_len=MAX_MODEL_LEN)) as port:
        base = f"http://127.0.0.1:{port}"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
        assert good.chat.completions.create(model=MODEL, messages=GOOD_CHAT["messages"]).choices
        with pytest.raises(anthropic.AuthenticationError):
            anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(
                model=MODEL, max_tokens=5, messages=GOOD_MESSAGES["messages"])
        claude = anthropic.Anthropic(base_url=base, api_key=KEY, max_retries=0)  # x-api-key
        assert claude.messages.create(model=MODEL, max_tokens=64,
                                      messages=GOOD_MESSAGES["messages"]).content
        assert_openai_error(httpx.post(f"{base}/v1/chat/completions", json=GOOD_CHAT), 401, None)
        assert_anthropic_error(httpx.post(f"{base}/v1/messages", json=GOOD_MESSAGES), 401,
                               "authentication_error")
        # Probes and scrapers need no key.
        assert httpx.get(f"{base}/health").status_code == 200
        assert httpx.get(f"{base}/metrics").status_code == 200


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"model": MODEL, "stream": True,
                              "messages": [{"role": "user", "content": "[long]"}]}),
    ("/v1/messages", {"model": MODEL, "stream": True, "max_tokens": 1000,
                      "messages": [{"role": "user", "content": "[long]"}]}),
])
def test_client_disconnect_aborts_the_request(slow, path, body):
    base, engine = slow
    rid, ticks = None, 0  # ticks: data events seen
    with httpx.stream("POST", f"{base}{path}", json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                data = json.loads(line[6:])
                rid = rid or data.get("id") or data.get("message", {}).get("id")
                ticks += 1
            if ticks >= 20:  # mid-stream: "[long]" is 400 ticks, 1000+ tokens
                break
    assert rid is not None and ticks >= 20
    deadline = time.monotonic() + 10
    while (rid in engine.active or rid not in engine.aborted) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert rid in engine.aborted and rid not in engine.active, \
        "the engine request kept running after the client left"
    assert len(engine.prompts) >= 1 and engine.params[rid].max_tokens > 100
    r = httpx.post(f"{base}/v1/chat/completions", json=GOOD_CHAT, timeout=30)
    assert r.status_code == 200


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "[long]"}]}),
    ("/v1/messages", {"model": MODEL, "max_tokens": 1000,
                      "messages": [{"role": "user", "content": "[long]"}]}),
])
def test_non_streaming_client_that_gives_up_aborts_the_request(slow, path, body):
    base, engine = slow
    before = len(engine.aborted)
    with pytest.raises(httpx.ReadTimeout):  # [long] takes ~5 s; the client waits 0.3 s
        httpx.post(f"{base}{path}", json=body, timeout=0.3)
    deadline = time.monotonic() + 10
    while (engine.active or len(engine.aborted) == before) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not engine.active and len(engine.aborted) == before + 1
    assert_still_serving(base)


async def _one_stream(client: httpx.AsyncClient, i: int) -> str:
    if i % 2:
        body = {**GOOD_MESSAGES, "stream": True}
        async with client.stream("POST", "/v1/messages", json=body) as r:
            assert r.status_code == 200
            events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
        assert json.loads(events[-1][6:]) == {"type": "message_stop"}
        deltas = [json.loads(e[6:]) for e in events]
        return "".join(d["delta"].get("text", "") for d in deltas
                       if d["type"] == "content_block_delta")
    body = {**GOOD_CHAT, "stream": True}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


def test_load_64_concurrent_streams(slow):
    base, engine = slow
    engine.peak_active = 0

    async def main() -> list[str]:
        limits = httpx.Limits(max_connections=128)
        async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as client:
            return await asyncio.gather(*(_one_stream(client, i) for i in range(64)))

    start = time.monotonic()
    answers = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert answers == ["Hi! How are you?"] * 64
    assert engine.peak_active >= 16, "the streams did not overlap"
    assert time.monotonic() - start < 60


def test_metrics(base):
    httpx.post(f"{base}/v1/chat/completions", json=GOOD_CHAT, timeout=30)
    httpx.post(f"{base}/v1/chat/completions", content=b"{", headers=JSON, timeout=30)
    values = scrape(base)
    labels = {"model_name": MODEL}
    assert metric(values, "vllm:num_requests_running", **labels) == 0
    assert metric(values, "vllm:num_requests_waiting", **labels) == 0
    assert metric(values, "vllm:kv_cache_usage_perc", **labels) == 0.25  # the fake's stats
    assert metric(values, "autoopt:kv_cache_capacity_tokens", **labels) == 4096
    assert metric(values, "autoopt:engine_healthy", **labels) == 1
    assert metric(values, "vllm:generation_tokens_total", **labels) > 0
    assert metric(values, "vllm:prompt_tokens_total", **labels) > 0
    assert metric(values, "vllm:time_to_first_token_seconds_count", **labels) >= 1
    assert metric(values, "vllm:inter_token_latency_seconds_count", **labels) >= 1
    assert metric(values, "vllm:e2e_request_latency_seconds_count", **labels) >= 1
    assert metric(values, "vllm:request_success_total", finished_reason="stop") >= 1
    assert metric(values, "autoopt:requests_finished_total", endpoint="chat",
                  finished_reason="stop") >= 1
    assert metric(values, "http_requests_total", handler="/v1/chat/completions",
                  method="POST", status="400") >= 1
    assert metric(values, "http_requests_total", handler="/v1/chat/completions",
                  method="POST", status="200") >= 1
    assert not server_errors(values)
    buckets = sorted((float(dict(ls)["le"]), v) for (n, ls), v in values.items()
                     if n == "vllm:time_to_first_token_seconds_bucket")
    assert [v for _, v in buckets] == sorted(v for _, v in buckets)  # cumulative


def test_unknown_paths_share_one_metrics_label(base):
    for i in range(5):
        httpx.get(f"{base}/no/such/path/{i}", timeout=30)
    values = scrape(base)
    handlers = {dict(ls)["handler"] for (n, ls), _ in values.items() if n == "http_requests_total"}
    assert "other" in handlers and not any(h.startswith("/no/") for h in handlers)
