"""The HTTP API on the real engine (tiny random-weight demo checkpoint, CPU), and `autoopt serve`.

The model's output is noise, so these tests check plumbing that must hold for any output:
greedy results equal the offline engine's, streaming equals non-streaming, forced tool calls
happen, aborts free the engine, and concurrent clients all finish. Token counts stay small
because each engine step of the tiny model costs tens of milliseconds on a CPU.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from model.demo import write_demo_checkpoint
from model.serve.engine import AsyncEngine, EngineConfig, LLMEngine
from model.serve.engine.sampler import SamplingParams
from model.serve.http.app import create_app
from tests.api_support import serve

MODEL = "beam-demo"
ENGINE_KW = {"device": "cpu", "dtype": "float32", "kernels": "reference", "max_model_len": 384,
             "max_num_seqs": 16, "kv_cache_bytes": 32 * 2**20}
WEATHER_TOOL = {"type": "function", "function": {"name": "weather.lookup", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo"), "tiny", seed=0)


@pytest.fixture(scope="module")
def engine(checkpoint) -> AsyncEngine:
    return AsyncEngine.from_config(EngineConfig(model=str(checkpoint), **ENGINE_KW))


@pytest.fixture(scope="module")
def base(engine) -> Iterator[str]:
    # The tokenizer and its chat template come from the checkpoint's tokenizer_config.json.
    app = create_app(engine, engine.tokenizer, MODEL, max_model_len=engine.max_model_len)
    with serve(app) as port:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def oai(base):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)


def hello(text: str = "Hello there") -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_greedy_completion_equals_offline_engine(oai, checkpoint, engine):
    prompt = engine.tokenizer.encode("The weather in Paris is")
    r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                               extra_body={"skip_special_tokens": False})
    offline = LLMEngine(EngineConfig(model=str(checkpoint), **ENGINE_KW))
    (want,) = offline.generate([prompt], SamplingParams(max_tokens=6, temperature=0))
    ids = [t for t in want.token_ids if t not in offline.stop_token_ids]
    assert r.choices[0].text == engine.tokenizer.decode(ids)
    assert r.usage.completion_tokens == len(want.token_ids)
    assert r.choices[0].finish_reason == want.finish_reason


def test_chat_stream_equals_non_stream(oai):
    kw = {"model": MODEL, "messages": hello(), "max_tokens": 10, "temperature": 0}
    r = oai.chat.completions.create(**kw)
    msg = r.choices[0].message
    content, reasoning, finish = [], [], None
    for chunk in oai.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            content.append(c.delta.content or "")
            reasoning.append(getattr(c.delta, "reasoning_content", None) or "")
            finish = c.finish_reason or finish
    assert "".join(content) == (msg.content or "")
    assert "".join(reasoning) == (getattr(msg, "reasoning_content", None) or "")
    assert finish == r.choices[0].finish_reason
    assert 1 <= r.usage.completion_tokens <= 10


def test_named_tool_choice_with_reasoning_budget(oai):
    """Effort minimal (32 tokens): the server cuts the reasoning, then forces the named call."""
    r = oai.chat.completions.create(
        model=MODEL, messages=hello("Weather?"), tools=[WEATHER_TOOL], temperature=0,
        tool_choice={"type": "function", "function": {"name": "weather.lookup"}},
        reasoning_effort="minimal", max_tokens=40)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "weather.lookup"
    assert isinstance(json.loads(call.function.arguments), dict)
    assert r.usage.completion_tokens_details.reasoning_tokens <= 32
    assert r.usage.completion_tokens <= 40
    # The demo vocabulary's reserved special tokens are not part of the format: never shown.
    assert "<|reserved" not in (getattr(r.choices[0].message, "reasoning_content", "") or "")


def test_logprobs_from_the_engine(oai):
    r = oai.chat.completions.create(model=MODEL, messages=hello(), max_tokens=5, temperature=0,
                                    logprobs=True, top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    for e in entries:  # greedy: the chosen token is the most likely one
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob)


def test_anthropic_stream_equals_non_stream(base):
    claude = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=120)
    # This SDK version has no `temperature` argument; the API still takes it in the body.
    kw = {"model": MODEL, "messages": hello(), "max_tokens": 8, "extra_body": {"temperature": 0},
          "thinking": {"type": "disabled"}}
    m = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as stream:
        s = stream.get_final_message()
    assert [b.model_dump() for b in s.content] == [b.model_dump() for b in m.content]
    assert s.stop_reason == m.stop_reason and s.usage.output_tokens == m.usage.output_tokens
    assert m.usage.output_tokens <= 8


def test_disconnect_frees_the_engine(base, engine):
    aborted = engine.stats().requests_finished_total["abort"]
    body = {"model": MODEL, "messages": hello(), "max_tokens": 300, "stream": True,
            "temperature": 0.8, "seed": 1}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (engine.stats().num_running or engine.stats().
                                           requests_finished_total["abort"] == aborted):
        time.sleep(0.05)
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.requests_finished_total["abort"] == aborted + 1


def test_concurrent_streams_all_finish(base):
    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {"model": MODEL, "messages": hello(f"Request {i}"), "max_tokens": 4,
                "stream": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            data = [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]"
        return json.loads(data[-2])["usage"]["completion_tokens"]

    async def main() -> list[int]:
        async with httpx.AsyncClient(base_url=base, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    counts = asyncio.run(asyncio.wait_for(main(), timeout=120))
    assert len(counts) == 16 and all(1 <= n <= 4 for n in counts)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_autoopt_serve_cli_serves_the_demo(checkpoint):
    port = _free_port()
    # The API key comes from the environment (kept out of `ps`), as AUTOOPT_API_KEY.
    env = {**os.environ, "AUTOOPT_DEMO_CHECKPOINT": str(checkpoint), "AUTOOPT_API_KEY": "k3y"}
    cmd = [sys.executable, "-c", "from autoopt.cli import app; app()", "serve", "--port",
           str(port), "--device", "cpu", "--dtype", "float32", "--kernels", "reference",
           "--max-model-len", "256", "--served-model-name", "demo"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "autoopt serve did not come up in 90 s"
            time.sleep(0.25)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                          max_retries=0).models.list()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k3y",
                               max_retries=0, timeout=60)
        r = client.chat.completions.create(model="demo", messages=hello(), max_tokens=3)
        assert r.usage.completion_tokens <= 3
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert "serving the tiny demo checkpoint" in out
    assert f"http://127.0.0.1:{port}/v1" in out and "KV capacity" in out


@pytest.mark.gpu
def test_gpu_api_smoke(checkpoint):
    """On the GPU (CUDA-graph decode): greedy stream == non-stream, and 32 concurrent streams."""
    engine = AsyncEngine.from_config(EngineConfig(
        model=str(checkpoint), device="cuda", dtype="bfloat16", kernels="reference",
        max_model_len=1024, max_num_seqs=32))
    with serve(create_app(engine, engine.tokenizer, MODEL,
                          max_model_len=engine.max_model_len)) as port:
        base = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
        kw = {"model": MODEL, "messages": hello(), "max_tokens": 64, "temperature": 0}
        r = client.chat.completions.create(**kw)
        streamed = "".join(c.choices[0].delta.content or "" for c in
                           client.chat.completions.create(**kw, stream=True) if c.choices)
        assert streamed == (r.choices[0].message.content or "")

        async def main() -> list[int]:
            async with httpx.AsyncClient(base_url=base, timeout=120) as http:
                async def one(i: int) -> int:
                    body = {**kw, "messages": hello(f"Request {i}"), "stream": True,
                            "stream_options": {"include_usage": True}}
                    async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                        data = [x[6:] async for x in resp.aiter_lines() if x.startswith("data: ")]
                    assert data[-1] == "[DONE]"
                    return json.loads(data[-2])["usage"]["completion_tokens"]
                return await asyncio.gather(*(one(i) for i in range(32)))

        counts = asyncio.run(asyncio.wait_for(main(), timeout=120))
        assert all(1 <= n <= 64 for n in counts)
