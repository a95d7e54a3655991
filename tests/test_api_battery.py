"""Every bad input in a row against one real-engine server, then: is it still well?

One server (tiny demo model, BF16, CPU, `autoopt serve`'s uvicorn setup) receives each bad request
of both APIs (tests/api_cases.py), bodies that are not JSON, cross-origin requests (one carrying
the temperature that used to stop the engine), oversized, stalled and abandoned uploads, a stalled
head, clients that leave mid-stream and mid-request, and the numeric extremes that used to stop
the engine. Afterwards `/health` is 200, `/metrics` counts no 5xx, every KV page is free, and a
greedy request answers exactly as it did before the battery.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from model.demo import write_demo_checkpoint
from model.serve.engine import AsyncEngine, EngineConfig
from model.serve.http.app import create_app
from model.serve.http.limits import HTTPLimits
from tests.api_cases import (
    BAD_CHAT,
    BAD_COMPLETIONS,
    BAD_MESSAGES,
    GOOD_CHAT,
    GOOD_MESSAGES,
    JSON,
    MAX_MODEL_LEN,
    NOT_JSON,
    raw_json_with,
)
from tests.api_support import MODEL, metric, scrape, serve, server_errors, torch_threads

LIMITS = HTTPLimits(max_request_bytes=256 * 1024, body_timeout_s=1.0, header_timeout_s=1.0)
PROMPT = "The weather in Paris is"


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[tuple[str, AsyncEngine]]:
    ckpt = write_demo_checkpoint(tmp_path_factory.mktemp("demo"), "tiny", seed=0)
    engine = AsyncEngine.from_config(EngineConfig(
        model=str(ckpt), device="cpu", dtype="bfloat16", kernels="reference",
        max_model_len=MAX_MODEL_LEN, max_num_seqs=8, kv_cache_bytes=16 * 2**20))
    app = create_app(engine, engine.tokenizer, MODEL, max_model_len=MAX_MODEL_LEN, limits=LIMITS)
    with torch_threads(1), serve(app, LIMITS) as port:
        yield f"http://127.0.0.1:{port}", engine


def _raw(port: int, data: bytes, read: bool = True) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        out = b""
        while read and (chunk := sock.recv(65536)):
            out += chunk
        return out


def _head(path: str, length: int, kind: str = "application/json") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\ncontent-type: {kind}\r\n"
            f"content-length: {length}\r\n\r\n").encode()


def _greedy(base: str) -> tuple[str, list[int]]:
    oai = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
    r = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                               logprobs=0, extra_body={"skip_special_tokens": False})
    return r.choices[0].text, [round(x, 6) for x in r.choices[0].logprobs.token_logprobs]


def _send_api_cases(c: httpx.Client) -> list[str]:
    """The bad requests of tests/api_cases.py; returns what was not a 4xx."""
    wrong = []
    for name, (body, _, _) in BAD_CHAT.items():
        r = c.post("/v1/chat/completions", content=body, headers=JSON)
        wrong += [f"chat {name}: {r.status_code}"] if not 400 <= r.status_code < 500 else []
    for body, _ in BAD_COMPLETIONS:
        r = c.post("/v1/completions", json=body)
        wrong += [f"completion {body}: {r.status_code}"] if r.status_code != 400 else []
    for name, (body, _, _) in BAD_MESSAGES.items():
        r = c.post("/v1/messages", content=body, headers=JSON)
        ok = 400 <= r.status_code < 500 and r.json()["type"] == "error"
        wrong += [] if ok else [f"messages {name}: {r.status_code}"]
    for name, (path, body, headers) in NOT_JSON.items():
        r = c.post(path, content=body, headers=headers)
        wrong += [f"{name}: {r.status_code}"] if r.status_code != 415 else []
    return wrong


def _send_web_abuse(c: httpx.Client, port: int) -> list[str]:
    """Cross-origin, oversized, stalled, abandoned and vanishing clients."""
    wrong = []
    # A page's "simple" request carrying the temperature that used to stop the engine.
    killer = raw_json_with(GOOD_CHAT, "temperature", "1e-45")
    for headers in ({"content-type": "text/plain", "origin": "http://evil.example"},
                    {**JSON, "origin": "null"}):
        r = c.post("/v1/chat/completions", content=killer, headers=headers)
        wrong += [f"cross-origin: {r.status_code}"] if r.status_code != 403 else []
    checks = {
        "oversized head": (_raw(port, _head("/v1/chat/completions", 50_000_000)), b" 413 "),
        "stalled body": (_raw(port, _head("/v1/messages", 500) + b'{"model": "b'), b" 408 "),
        "stalled head": (_raw(port, b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nconte"), b""),
    }
    for name, (out, want) in checks.items():
        ok = want in out.split(b"\r\n")[0] if want else out == b""
        wrong += [] if ok else [f"{name}: {out[:60]!r}"]
    for path in ("/v1/chat/completions", "/v1/messages"):  # uploads abandoned half way
        _raw(port, _head(path, 5000) + b'{"model": "beam-test", "mess', read=False)
    big = {**GOOD_CHAT, "messages": [{"role": "user", "content": "x" * 300_000}]}
    r = c.post("/v1/chat/completions", content=iter([json.dumps(big).encode()]), headers=JSON)
    wrong += [f"chunked oversize: {r.status_code}"] if r.status_code != 413 else []
    for path in ("/v1/nothing", "/v1/chat/completions"):
        r = c.get(path)
        wrong += [f"GET {path}: {r.status_code}"] if r.status_code not in (404, 405) else []
    return wrong


def _leave_early(c: httpx.Client, base: str) -> None:
    """A stream abandoned after a few events, and a request abandoned before its answer."""
    body = {**GOOD_CHAT, "stream": True, "max_tokens": 200, "temperature": 0.9, "seed": 3}
    with c.stream("POST", "/v1/chat/completions", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i >= 6:
                break
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/v1/messages", json={**GOOD_MESSAGES, "max_tokens": 300},
                   timeout=0.2)


def _accepted_extremes(c: httpx.Client) -> list[str]:
    """The values that used to stop the engine, at the edge of what is valid: served."""
    wrong = []
    for extra in ({"temperature": 1e-45}, {"temperature": 5e-3, "seed": -(2**63)},
                  {"temperature": 1.0, "seed": 2**63 - 1, "top_k": 2048}):
        r = c.post("/v1/chat/completions", json={**GOOD_CHAT, "max_tokens": 4, **extra})
        wrong += [f"{extra}: {r.status_code}"] if r.status_code != 200 else []
        r = c.post("/v1/messages", json={**GOOD_MESSAGES, "max_tokens": 4, **extra})
        wrong += [f"messages {extra}: {r.status_code}"] if r.status_code != 200 else []
    return wrong


@pytest.mark.slow
def test_every_bad_input_in_a_row_leaves_the_server_well(server):
    base, engine = server
    port = int(base.rsplit(":", 1)[1])
    before = _greedy(base)
    with httpx.Client(base_url=base, timeout=60) as c:
        wrong = _send_api_cases(c)
        wrong += _send_web_abuse(c, port)
        _leave_early(c, base)
        wrong += _accepted_extremes(c)
    assert not wrong, wrong
    deadline = time.monotonic() + 30
    while engine.stats().num_running and time.monotonic() < deadline:
        time.sleep(0.05)  # the abandoned requests are being aborted

    assert httpx.get(f"{base}/health", timeout=10).json() == {"status": "ok"}
    values = scrape(base)
    assert not server_errors(values), server_errors(values)
    assert metric(values, "autoopt:engine_healthy") == 1
    assert metric(values, "http_requests_total", status="499") >= 2  # the uploads that left
    assert metric(values, "vllm:request_success_total", finished_reason="error") == 0
    stats = engine.stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    cache = engine.engine.cache
    assert all(pool.num_free == pool.num_usable for pool in cache.pools.values())
    assert _greedy(base) == before
