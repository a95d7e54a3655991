"""Test support for the agents: a scripted Anthropic-compatible server on loopback, and a
harness context on a temporary registry.

The server implements POST /v1/messages with a queue of scripted replies (message JSON with
tool_use blocks, or an HTTP error status) and records every request body, so a test can assert
what the real `anthropic` SDK sent, e.g. the tool_result that carried a rejection reason.
"""

from __future__ import annotations

import itertools
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

_IDS = itertools.count(1)


def tool_use(tool: str, /, **inputs: Any) -> dict:
    return {"type": "tool_use", "id": f"toolu_{next(_IDS):04d}", "name": tool, "input": inputs}


def message(*blocks: dict, stop_reason: str = "tool_use", text: str | None = None) -> dict:
    content = ([{"type": "text", "text": text}] if text else []) + list(blocks)
    return {"id": f"msg_{next(_IDS):04d}", "type": "message", "role": "assistant",
            "model": "claude-sonnet-5-5", "content": content, "stop_reason": stop_reason,
            "stop_sequence": None, "usage": {"input_tokens": 1000, "output_tokens": 200}}


def error(status: int) -> dict:
    kind = {429: "rate_limit_error", 500: "api_error", 529: "overloaded_error"}.get(status,
                                                                                   "api_error")
    return {"status": status, "body": {"type": "error", "error": {"type": kind,
                                                                  "message": f"scripted {status}"}}}


class ScriptedAnthropic:
    """`with ScriptedAnthropic(replies) as server:` then point ANTHROPIC_BASE_URL at server.url."""

    def __init__(self, replies: list[dict], repeat_last: bool = False) -> None:
        self.replies, self.repeat_last = list(replies), repeat_last
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.statuses: list[int] = []
        self._lock = threading.Lock()

    def _next(self) -> dict:
        with self._lock:
            if not self.replies:
                return error(500)
            return self.replies[0] if self.repeat_last and len(self.replies) == 1 else \
                self.replies.pop(0)

    def __enter__(self) -> ScriptedAnthropic:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append(body)
                server.headers.append(dict(self.headers))
                reply = server._next()
                status = reply.get("status", 200)
                payload = json.dumps(reply.get("body", reply)).encode()
                server.statuses.append(status)
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(payload)))
                self.send_header("retry-after-ms", "1")  # keeps the SDK's own retries fast
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args: Any) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def tool_results(self, request_index: int) -> list[dict]:
        """The tool_result blocks of the last user message of one recorded request."""
        last = self.requests[request_index]["messages"][-1]
        content = last["content"] if isinstance(last["content"], list) else []
        return [b for b in content if b.get("type") == "tool_result"]


def harness(tmp: Path, op: str, *, verify_tokens: tuple[int, ...] = (5,)):
    """(ctx, task, evaluator, recorded) on a temporary registry for the cpu-tiny target."""
    from autoopt.agents.base import OptimizationTask
    from autoopt.loop import bench_shapes
    from autoopt.loop_eval import HarnessEvaluator, RunContext
    from autoopt.targets import load_target
    from model.registry import Registry

    target = load_target("cpu-tiny")
    run_dir = tmp / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    ctx = RunContext(run_dir=run_dir, registry=Registry(tmp / "registry"), target=target,
                     arch="cpu", gpu="cpu", verify_seeds=(0,), verify_tokens=verify_tokens,
                     bench_iters=2, tune_iters=2, verify_timeout_s=120)
    shapes = bench_shapes(target, op)
    task = OptimizationTask.build(op, hardware={"gpu": "cpu"}, shapes=shapes, device="cpu",
                                  profile_row={"op": op, "time_us": 100.0, "floor_us": 1.0,
                                               "gap_us": 99.0}, floor_us=1.0)
    recorded: list[tuple] = []
    evaluator = HarnessEvaluator(ctx, task, "cpu", shapes,
                                 lambda o, a, p: recorded.append((o, a, p)))
    return ctx, task, evaluator, recorded


def registry_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []
