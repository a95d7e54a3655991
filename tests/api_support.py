"""Test support for the HTTP API: a scripted fake engine and a uvicorn server on loopback.

The fake engine "generates" the tokenization of a scripted Harmony response chosen by the last
user message, so format and HTTP tests are deterministic. It continues correctly after the text
the server forces (reasoning cut, tool-call headers), like a model that follows the format.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn

from model.serve.engine.sampler import TokenLogprob
from model.serve.http.limits import HTTPLimits
from model.serve.http.server import uvicorn_config
from model.serve.tokenizer import BeamTokenizer

MODEL = "beam-test"
VOCAB = 640  # the demo BPE's size in the tokenizer tests: big enough for the format's words

CALL_HEADER = "<|channel|>analysis <|constrain|>xml<|message|>"
WEATHER_ARGS = (
    '<rfl:parameter name="city">\nParis\n</rfl:parameter>'
    '<rfl:parameter name="days">\n3\n</rfl:parameter>'
    '<rfl:parameter name="verbose">\ntrue\n</rfl:parameter>'
)
HELLO = ("<|channel|>analysis<|message|>The user greets me.<|end|>"
         "<|start|>assistant<|channel|>final<|message|>Hi! How are you?<|return|>")
WEATHER = ("<|channel|>analysis<|message|>Need the forecast.<|end|>"
           f"<|start|>assistant to=weather.lookup{CALL_HEADER}{WEATHER_ARGS}<|call|>")
# Parallel calls: <|call|> is a stop token, so the calls before the last close at <|end|>.
PARALLEL = ("<|channel|>analysis<|message|>Two cities.<|end|>"
            f"<|start|>assistant to=weather.lookup{CALL_HEADER}"
            '<rfl:parameter name="city">\nParis\n</rfl:parameter><|end|>'
            f"<|start|>assistant to=clock{CALL_HEADER}"
            '<rfl:parameter name="opts">\n{"tz": "CET"}\n</rfl:parameter><|call|>')
RAMBLE = ("<|channel|>analysis<|message|>" + "word " * 300 + "<|end|>"
          "<|start|>assistant<|channel|>final<|message|>late<|return|>")
NO_TOOL = ("<|channel|>analysis<|message|>No tool is needed.<|end|>"
           "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>")
# Keeps going after its stop token: the server must stop at <|call|> itself.
PAST_STOP = HELLO.replace("<|return|>", "<|call|>") + " junk after the stop token" * 3
LONG = "<|channel|>final<|message|>" + "tick " * 400 + "<|return|>"
STOPWORD = "<|channel|>analysis<|message|>ok<|end|><|start|>assistant<|channel|>final<|message|>" \
    "alpha beta STOP gamma<|return|>"
PLAIN = "<|channel|>final<|message|>Plain answer.<|return|>"
STOP_IN_THINKING = "<|channel|>analysis<|message|>hmm<|return|>"

SCRIPTS: dict[str, str] = {
    "[hello]": HELLO, "[weather]": WEATHER, "[parallel]": PARALLEL, "[ramble]": RAMBLE,
    "[notool]": NO_TOOL, "[paststop]": PAST_STOP, "[long]": LONG, "[stopword]": STOPWORD,
    "[stopthink]": STOP_IN_THINKING,
}
FORCED_CLOSE_ANSWER = "<|channel|>final<|message|>Done thinking.<|return|>"


def split_prompt(prompt: str) -> tuple[str, str]:
    """(last user message, assistant text already in the prompt after the generation prompt)."""
    user_at = prompt.rfind("<|start|>user<|message|>")
    user = prompt[user_at + len("<|start|>user<|message|>"):]
    user = user[: user.find("<|end|>")] if user_at >= 0 else ""
    last = max(prompt.rfind(f"<|start|>{role}") for role in ("user", "tool", "system"))
    if last < 0:  # a raw completion prompt
        return "", ""
    rest = prompt[last:]
    at = rest.find("<|start|>assistant")
    return user, rest[at + len("<|start|>assistant"):] if at >= 0 else ""


def continuation(prompt: str) -> str:
    user, so_far = split_prompt(prompt)
    script = next((s for key, s in SCRIPTS.items() if key in user), PLAIN)
    if script.startswith(so_far):
        return script[len(so_far):]
    if so_far.endswith(" to="):  # tool_choice required: name a tool
        return f"weather.lookup{CALL_HEADER}{WEATHER_ARGS}<|call|>"
    if so_far.endswith(CALL_HEADER):  # tool_choice named: write the arguments
        return f"{WEATHER_ARGS}<|call|>"
    if so_far.endswith("<|start|>assistant"):  # reasoning force-closed
        return FORCED_CLOSE_ANSWER
    raise AssertionError(f"the fake engine cannot continue {so_far[-80:]!r}")


@functools.cache
def demo_tokenizer() -> BeamTokenizer:
    return BeamTokenizer.demo(VOCAB)  # trains the demo BPE (~3 s): once per test session


@dataclass
class FakeOutput:
    request_id: str
    new_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: Any = None


class FakeRequestError(ValueError):
    pass


@dataclass
class FakeEngine:
    tokenizer: BeamTokenizer
    delay: float = 0.0  # seconds per token; >0 lets a client disconnect mid-stream
    honor_stop_ids: bool = True
    prompts: dict[str, str] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    aborted: list[str] = field(default_factory=list)
    active: set[str] = field(default_factory=set)
    peak_active: int = 0
    started: bool = False

    def start(self) -> None:
        self.started = True

    def shutdown(self) -> None:
        self.started = False

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def _logprobs(self, tid: int, n: int | None) -> list[TokenLogprob] | None:
        if n is None:
            return None
        top = tuple(((tid + k) % self.tokenizer.vocab_size, -0.25 - k) for k in range(n))
        return [TokenLogprob(tid, -0.25 - (tid % 7), top)]  # made up, but per-token distinct

    def stats(self) -> dict[str, Any]:
        return {"running": len(self.active), "waiting": 0, "kv_usage": 0.25,
                "capacity_tokens": 4096, "page_size": 16}

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: Any
    ) -> AsyncIterator[FakeOutput]:
        if request_id in self.active:
            raise FakeRequestError(f"request id {request_id} is already running")
        prompt = self.tokenizer.decode(prompt_token_ids)
        self.prompts[request_id], self.params[request_id] = prompt, params
        ids = self.tokenizer.encode(continuation(prompt))
        self.active.add(request_id)
        self.peak_active = max(self.peak_active, len(self.active))
        out: list[int] = []
        try:
            for i, tid in enumerate(ids):
                await asyncio.sleep(self.delay)
                if request_id in self.aborted:
                    return
                out.append(tid)
                finish = None
                if self.honor_stop_ids and tid in params.stop_token_ids:
                    finish = "stop"
                elif len(out) >= params.max_tokens:
                    finish = "length"
                elif i == len(ids) - 1:
                    finish = "stop"
                yield FakeOutput(request_id, [tid], list(out), finish, len(prompt_token_ids),
                                 len(out), self._logprobs(tid, params.logprobs))
                if finish:
                    return
        finally:
            self.active.discard(request_id)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Tiny models on a shared CPU: OpenMP threads spinning for tiny ops cost more than they
    give (up to 20x per step under load), so real-engine test modules run on one."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def serve(app: Any, limits: HTTPLimits | None = None) -> Iterator[int]:
    """Run `app` as `autoopt serve` runs it (uvicorn, the head-timeout protocol) on a free
    127.0.0.1 port in a thread; yields the port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn_config(app, "127.0.0.1", port, limits or HTTPLimits(), log_level="warning",
                            lifespan="on", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start within 30 s")
        time.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def scrape(base: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """/metrics as {(sample name, labels): value}, parsed by prometheus_client."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(f"{base}/metrics", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def metric(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples named `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def server_errors(samples: dict) -> dict[str, float]:
    """5xx responses counted in http_requests_total, by status."""
    out: dict[str, float] = {}
    for (name, labels), value in samples.items():
        status = dict(labels).get("status", "")
        if name == "http_requests_total" and status.startswith("5") and value:
            out[status] = out.get(status, 0) + value
    return out
