"""The web's rules for a local server, over real HTTP on loopback (scripted engine).

Cross-origin requests are refused unless allowed, slow clients time out, a client that vanishes
is not a server error, bodies are capped, and tokenization never blocks the event loop.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from model.serve.http.app import create_app
from model.serve.http.limits import HTTPLimits
from tests.api_cases import GOOD_CHAT, GOOD_MESSAGES, JSON, MAX_MODEL_LEN, with_
from tests.api_support import (
    MODEL,
    FakeEngine,
    demo_tokenizer,
    metric,
    scrape,
    serve,
    server_errors,
)

EVIL = "http://evil.example"
FRIEND = "http://localhost:3000"
LIMITS = HTTPLimits(max_request_bytes=64 * 1024, body_timeout_s=1.0, header_timeout_s=1.0)


@pytest.fixture(scope="module")
def fake() -> FakeEngine:
    return FakeEngine(demo_tokenizer())


@pytest.fixture(scope="module")
def base(fake) -> Iterator[str]:
    app = create_app(fake, demo_tokenizer(), MODEL, max_model_len=MAX_MODEL_LEN, limits=LIMITS)
    with serve(app, LIMITS) as port:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def friendly(fake) -> Iterator[str]:
    app = create_app(fake, demo_tokenizer(), MODEL, max_model_len=MAX_MODEL_LEN,
                     allowed_origins=(FRIEND,))
    with serve(app) as port:
        yield f"http://127.0.0.1:{port}"


class ErrorLog(logging.Handler):
    """ERROR records of the server (its loggers and uvicorn's, which does not propagate)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def error_log() -> Iterator[ErrorLog]:
    handler = ErrorLog()
    loggers = [logging.getLogger(name) for name in (None, "uvicorn", "uvicorn.error")]
    for lg in loggers:
        lg.addHandler(handler)
    yield handler
    for lg in loggers:
        lg.removeHandler(handler)


def raw(port: int, data: bytes, then_wait: float = 5.0, close: bool = False) -> bytes:
    """Send `data` on a fresh connection; return what the server sends before it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=then_wait) as sock:
        sock.sendall(data)
        if close:
            return b""
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except TimeoutError:
            out += b"<still open>"
        return out


def port_of(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


# ---- origins -------------------------------------------------------------------------------------
@pytest.mark.parametrize("method,path,headers,body", [
    ("POST", "/v1/chat/completions", {"content-type": "text/plain"}, with_(GOOD_CHAT)),
    ("POST", "/v1/chat/completions", JSON, with_(GOOD_CHAT)),
    ("POST", "/v1/messages", {"content-type": "text/plain"}, with_(GOOD_MESSAGES)),
    ("GET", "/v1/models", {}, b""),
    ("OPTIONS", "/v1/chat/completions", {"access-control-request-method": "POST"}, b""),
])
def test_cross_origin_requests_are_refused_by_default(base, fake, method, path, headers, body):
    before = len(fake.prompts)
    r = httpx.request(method, f"{base}{path}", content=body,
                      headers={**headers, "origin": EVIL}, timeout=30)
    assert r.status_code == 403, r.text
    assert "access-control-allow-origin" not in r.headers
    assert "--allowed-origins" in r.text and len(fake.prompts) == before
    if path == "/v1/messages":
        assert r.json()["error"]["type"] == "permission_error"
    else:
        assert r.json()["error"]["code"] == "origin_not_allowed"


def test_allowed_origins_get_cors_and_others_do_not(friendly):
    pre = httpx.options(f"{friendly}/v1/chat/completions", headers={
        "origin": FRIEND, "access-control-request-method": "POST",
        "access-control-request-headers": "content-type,authorization"}, timeout=30)
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == FRIEND
    r = httpx.post(f"{friendly}/v1/chat/completions", json=GOOD_CHAT,
                   headers={"origin": FRIEND}, timeout=30)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == FRIEND
    assert httpx.post(f"{friendly}/v1/chat/completions", json=GOOD_CHAT,
                      headers={"origin": EVIL}, timeout=30).status_code == 403
    # Without an Origin header (SDKs, curl) nothing changes.
    assert httpx.post(f"{friendly}/v1/chat/completions", json=GOOD_CHAT,
                      timeout=30).status_code == 200


# ---- slow and vanishing clients ------------------------------------------------------------------
def test_a_stalled_body_times_out(base):
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json"
            b"\r\ncontent-length: 400\r\n\r\n")
    start = time.monotonic()
    out = raw(port_of(base), head + b'{"model": "beam-', then_wait=10)
    assert out.startswith(b"HTTP/1.1 408"), out
    assert b'"code":"body_timeout"' in out and b"<still open>" not in out  # closed after
    assert time.monotonic() - start < 5


def test_a_stalled_head_is_closed(base):
    start = time.monotonic()
    out = raw(port_of(base), b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-ty",
              then_wait=10)
    assert out == b"" and time.monotonic() - start < 5


def test_a_byte_at_a_time_head_is_closed(base):
    """uvicorn's keep-alive timer restarts on every byte; the head deadline does not."""
    head = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100
    closed_after = None
    with socket.create_connection(("127.0.0.1", port_of(base)), timeout=5) as sock:
        start = time.monotonic()
        for byte in head:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                closed_after = time.monotonic() - start
                break
            time.sleep(0.1)
        else:
            closed_after = time.monotonic() - start if sock.recv(1) == b"" else None
    assert closed_after is not None and closed_after < 5


def test_a_client_that_leaves_during_its_upload_is_not_a_server_error(base, error_log):
    before = metric(scrape(base), "http_requests_total", handler="/v1/chat/completions",
                    status="499")
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json"
            b"\r\ncontent-length: 4000\r\n\r\n")
    for _ in range(3):
        raw(port_of(base), head + b'{"model": "beam-test", "mess', close=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        values = scrape(base)
        if metric(values, "http_requests_total", handler="/v1/chat/completions",
                  status="499") >= before + 3:
            break
        time.sleep(0.05)
    assert metric(values, "http_requests_total", handler="/v1/chat/completions",
                  status="499") == before + 3
    assert not server_errors(values) and not error_log.records
    r = httpx.post(f"{base}/v1/chat/completions", json=GOOD_CHAT, timeout=30)
    assert r.status_code == 200


# ---- sizes ---------------------------------------------------------------------------------------
def test_a_body_over_the_limit_is_refused_before_it_is_read(base, fake):
    before = len(fake.prompts)
    head = (b"POST /v1/messages HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 50000000\r\n\r\n")
    out = raw(port_of(base), head, then_wait=10)  # nothing of the 50 MB is sent
    assert out.startswith(b"HTTP/1.1 413") and b'"request_too_large"' in out
    # Chunked, so the size shows only while reading.
    big = {**GOOD_CHAT, "messages": [{"role": "user", "content": "x" * 100_000}]}
    r = httpx.post(f"{base}/v1/chat/completions", content=iter([with_(big)]), headers=JSON,
                   timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert len(fake.prompts) == before


def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(fake, monkeypatch):
    tok = demo_tokenizer()
    app = create_app(fake, tok, MODEL, max_model_len=MAX_MODEL_LEN)
    encoded: list[int] = []
    real = tok.encode
    monkeypatch.setattr(tok, "encode",
                        lambda text, **kw: encoded.append(len(text)) or real(text, **kw))
    limit = app.state.ctx.max_prompt_bytes
    with serve(app) as port:
        big = {**GOOD_CHAT, "messages": [{"role": "user", "content": "word " * (limit // 4)}]}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=big, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert "bytes" in r.json()["error"]["message"]
        assert not any(n > limit for n in encoded), "the oversized prompt was tokenized"


def test_tokenizing_does_not_block_the_event_loop(fake, monkeypatch):
    """A prompt that takes 2 s to render and tokenize leaves /health answering at once."""
    tok = demo_tokenizer()
    app = create_app(fake, tok, MODEL, max_model_len=MAX_MODEL_LEN)
    real = tok.encode

    def slow_encode(text, **kw):
        if "[slow]" in text:
            time.sleep(2)
        return real(text, **kw)

    monkeypatch.setattr(tok, "encode", slow_encode)
    with serve(app) as port:
        url = f"http://127.0.0.1:{port}"
        body = {**GOOD_CHAT, "messages": [{"role": "user", "content": "[slow]"}]}
        done: list[httpx.Response] = []
        worker = threading.Thread(target=lambda: done.append(
            httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)))
        worker.start()
        time.sleep(0.3)  # the slow request is tokenizing now
        start = time.monotonic()
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        assert time.monotonic() - start < 1.0
        worker.join(30)
        assert done and done[0].status_code == 200


# ---- flags ---------------------------------------------------------------------------------------
def test_serve_flags_and_the_api_key_from_the_environment(monkeypatch):
    from typer.testing import CliRunner

    import model.serve.http.server as server
    from autoopt.cli import app

    seen = []
    monkeypatch.setattr(server, "run_server", lambda opts, say: seen.append(opts))
    monkeypatch.setenv("AUTOOPT_API_KEY", "from-env")
    args = ["serve", "--allowed-origins", "http://a.test,http://b.test", "--allowed-origins",
            "http://c.test", "--max-request-bytes", "1000", "--body-timeout", "2",
            "--header-timeout", "3"]
    assert CliRunner().invoke(app, args).exit_code == 0
    opts = seen[-1]
    assert opts.api_key == "from-env"
    assert opts.allowed_origins == ("http://a.test", "http://b.test", "http://c.test")
    assert opts.limits == HTTPLimits(1000, 2.0, 3.0)
    assert CliRunner().invoke(app, ["serve", "--api-key", "flag"]).exit_code == 0
    assert seen[-1].api_key == "flag" and seen[-1].allowed_origins == ()
    monkeypatch.delenv("AUTOOPT_API_KEY")
    assert CliRunner().invoke(app, ["serve"]).exit_code == 0 and seen[-1].api_key is None
    bad = CliRunner().invoke(app, ["serve", "--body-timeout", "0"])
    assert bad.exit_code == 2 and "body_timeout_s must be > 0" in bad.output
