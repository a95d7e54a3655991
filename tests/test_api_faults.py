"""Failures inside the engine, injected at each stage, over real HTTP (tiny demo model, CPU).

A fault in one request's start, model step, sampling or detokenization fails that request with
a 500 in its API's shape (no exception text) while concurrent requests finish and the server
stays healthy. A fault in shared state (the scheduler) stops the engine: /health says so, and
the server exits with status 1.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

import model.serve.engine.llm_engine as llm_engine
import model.serve.http.server as server_mod
from model.demo import write_demo_checkpoint
from model.serve.engine import AsyncEngine, EngineConfig
from model.serve.engine.outputs import RequestState
from model.serve.http.app import create_app
from model.serve.http.server import ServeOptions, serve_until_stopped
from tests.api_support import metric, scrape, serve, torch_threads

MODEL = "beam-demo"
ENGINE_KW = {"device": "cpu", "dtype": "float32", "kernels": "reference", "max_model_len": 256,
             "max_num_seqs": 8, "kv_cache_bytes": 16 * 2**20}
SEEDS = {"starting": 6660, "running its model step": 6661, "sampling its next token": 6662,
         "detokenizing its output": 6663}


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo"), "tiny", seed=0)


def faulty(seed: int):
    return lambda params: params.seed == seed


@pytest.fixture(scope="module")
def engine(checkpoint) -> Iterator[AsyncEngine]:
    served = AsyncEngine.from_config(EngineConfig(model=str(checkpoint), **ENGINE_KW))
    eng = served.engine
    mp = pytest.MonkeyPatch()
    real_sampler, real_execute = eng.sampler, eng.runner.execute
    real_generator, real_add_token = llm_engine.make_generator, RequestState.add_token

    def sampler(logits, rows):
        if any(faulty(SEEDS["sampling its next token"])(r.params) for r in rows):
            raise RuntimeError("injected sampling fault")
        return real_sampler(logits, rows)

    def execute(chunks):
        bad = {s.seq_id for s in list(eng._requests.values())
               if faulty(SEEDS["running its model step"])(s.state.params)}
        if any(c.seq_id in bad for c in chunks):
            raise RuntimeError("injected step fault")
        return real_execute(chunks)

    def make_generator(seed, device):
        if seed == SEEDS["starting"]:
            raise RuntimeError("injected start fault")
        return real_generator(seed, device)

    def add_token(self, token, num_generated, num_tokens):
        if faulty(SEEDS["detokenizing its output"])(self.params) and num_generated >= 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")
        return real_add_token(self, token, num_generated, num_tokens)

    mp.setattr(eng, "sampler", sampler)
    mp.setattr(eng.runner, "execute", execute)
    mp.setattr(llm_engine, "make_generator", make_generator)
    mp.setattr(RequestState, "add_token", add_token)
    yield served
    mp.undo()


@pytest.fixture(scope="module")
def base(engine) -> Iterator[str]:
    app = create_app(engine, engine.tokenizer, MODEL, max_model_len=engine.max_model_len)
    with serve(app) as port:
        yield f"http://127.0.0.1:{port}"


def hello(text: str = "Hello there") -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


async def _bystander(client: httpx.AsyncClient, i: int) -> str | None:
    body = {"model": MODEL, "messages": hello(f"Bystander {i}"), "max_tokens": 24,
            "temperature": 0, "stream": True, "reasoning_effort": "none"}
    finish = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                data = json.loads(line[6:])
                assert "error" not in data, data
                finish = data["choices"][0]["finish_reason"] or finish
    return finish


def _faulty_call(base: str, stage: str, api: str, stream: bool) -> Exception:
    kw = {"temperature": 0.8, "max_tokens": 24}
    seed = SEEDS[stage]
    try:
        if api == "openai":
            oai = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
            out = oai.chat.completions.create(model=MODEL, messages=hello(), seed=seed,
                                              stream=stream, **kw)
            if stream:
                for _ in out:
                    pass
        else:
            claude = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0, timeout=120)
            # This SDK version has no `temperature` argument; the API takes it in the body.
            out = claude.messages.create(model=MODEL, messages=hello(), stream=stream,
                                         max_tokens=kw["max_tokens"],
                                         extra_body={"seed": seed, "temperature": 0.8})
            if stream:
                for _ in out:
                    pass
    except Exception as e:  # noqa: BLE001 - the test looks at which
        return e
    raise AssertionError(f"a {stage} fault was not reported")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("api", ["openai", "anthropic"])
@pytest.mark.parametrize("stage", list(SEEDS))
def test_a_fault_fails_only_its_request(base, engine, stage, api, stream):
    async def main() -> tuple[list[str | None], Exception]:
        async with httpx.AsyncClient(base_url=base, timeout=120) as client:
            tasks = [asyncio.create_task(_bystander(client, i)) for i in range(3)]
            await asyncio.sleep(0.2)  # the bystanders are in the batch
            err = await asyncio.to_thread(_faulty_call, base, stage, api, stream)
            return await asyncio.gather(*tasks), err

    errors_before = engine.stats().requests_finished_total["error"]
    finishes, err = asyncio.run(asyncio.wait_for(main(), timeout=180))
    assert finishes == ["length"] * 3 or all(f in ("length", "stop") for f in finishes)
    text = str(err)
    late = stream and stage == "detokenizing its output"  # after the first events: in-band
    if api == "openai" and not late:
        assert isinstance(err, openai.InternalServerError), repr(err)
    elif api == "anthropic" and not late:
        assert isinstance(err, anthropic.InternalServerError), repr(err)
        assert err.body["error"]["type"] == "api_error"
    assert stage in text and "request id" in text
    assert not any(leak in text for leak in ("injected", "RuntimeError", "UnicodeDecodeError"))
    assert engine.is_running and httpx.get(f"{base}/health").status_code == 200
    assert engine.stats().requests_finished_total["error"] == errors_before + 1
    assert engine.stats().num_running == 0
    assert metric(scrape(base), "vllm:request_success_total", finished_reason="error") >= 1


def test_the_engine_serves_normally_after_the_faults(base, engine):
    oai = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
    r = oai.completions.create(model=MODEL, prompt="The weather in Paris is", max_tokens=8,
                               temperature=0)
    again = oai.completions.create(model=MODEL, prompt="The weather in Paris is", max_tokens=8,
                                   temperature=0)
    assert r.choices[0].text == again.choices[0].text and r.usage.completion_tokens == 8
    cache = engine.engine.cache
    assert all(pool.num_free == pool.num_usable for pool in cache.pools.values())


# ---- a fault in shared state ------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_shared_state_fault_ends_the_server(checkpoint, monkeypatch, caplog):
    served = AsyncEngine.from_config(EngineConfig(model=str(checkpoint), **ENGINE_KW))
    monkeypatch.setattr(server_mod, "HEALTH_GRACE_S", 3.0)
    app = create_app(served, served.tokenizer, MODEL, max_model_len=served.max_model_len)
    opts = ServeOptions(port=_free_port())
    exits: list[BaseException] = []

    def run() -> None:
        try:
            serve_until_stopped(app, served, opts)
        except BaseException as e:  # noqa: BLE001 - SystemExit is the result under test
            exits.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{opts.port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            assert time.monotonic() < deadline
            time.sleep(0.1)

    def broken_schedule():
        raise RuntimeError("injected scheduler fault")

    monkeypatch.setattr(served.engine.scheduler, "schedule", broken_schedule)
    body = {"model": MODEL, "messages": hello(), "max_tokens": 4}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    assert "injected" not in r.text
    health = httpx.get(f"{url}/health", timeout=5)
    assert health.status_code == 503 and "restart" in health.json()["reason"]
    assert metric(scrape(url), "autoopt:engine_healthy") == 0
    thread.join(30)
    assert not thread.is_alive()
    assert len(exits) == 1 and isinstance(exits[0], SystemExit) and exits[0].code == 1
    fatal = [r.getMessage() for r in caplog.records if r.levelname == "CRITICAL"]
    assert any("must be restarted" in m and "injected scheduler fault" in m for m in fatal)
    assert any("exiting with status 1" in m for m in fatal)
