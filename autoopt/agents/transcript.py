"""A Claude session's transcript: written as it goes, and replayed from it without a key.

`Transcript` appends one JSON line per event (session start, request, response with its usage
and cost, tool result, harness feedback, API error, session end); the key is never in it.
`TranscriptClient` stands in for the Anthropic client and answers each request with the next
recorded response, so `replay_sessions` re-runs a recorded session through the same session
code: every tool is answered anew by this machine's harness (reads, checks, profiles) and every
submission is judged anew; the rows say, submission by submission, whether the verdict the run
recorded is reproduced. The recorded replies are replayed as they are even where a new verdict
differs (the model is not asked again), which is what makes the comparison meaningful.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

NAME = "transcript.jsonl"


class TranscriptEnd(RuntimeError):
    """The recorded session has no more replies."""


class Transcript:
    """Append-only JSONL of everything said in a session (never the key: it is not in here)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, kind: str, **data: Any) -> None:
        entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "kind": kind, **data}
        with self.path.open("a") as f:
            f.write(json.dumps(entry, default=str) + "\n")


def read(path: Path) -> list[dict]:
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a crash
    return out


class _Messages:
    def __init__(self, replies: Iterator[dict], model: str) -> None:
        self._replies, self._model = replies, model

    def create(self, **request: Any) -> Any:
        from anthropic.types import Message

        try:
            e = next(self._replies)
        except StopIteration:
            raise TranscriptEnd("the recorded session has no more replies") from None
        return Message.model_validate({
            "id": f"msg_replay_{e.get('turn', 0)}", "type": "message", "role": "assistant",
            "model": e.get("model") or self._model, "content": e["content"],
            "stop_reason": e.get("stop_reason"), "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0, **(e.get("usage") or {})}})


class TranscriptClient:
    """`client.messages.create(...)` answered from a recorded transcript, in order."""

    def __init__(self, entries: list[dict], model: str) -> None:
        self.messages = _Messages(iter([e for e in entries if e.get("kind") == "response"]),
                                  model)


def sessions(op_dir: Path) -> list[Path]:
    """Every transcript under an op's directory, in session order."""
    return sorted(Path(op_dir).rglob(NAME))


def replay_sessions(op_dir: Path, make: Callable[[], tuple[Any, Any]], out_dir: Path,
                    recorded: Callable[[str], list[str]]) -> list[dict]:
    """Replay every recorded session of one op. `make()` gives (task, evaluator) for the op;
    `recorded(session_name)` the verdicts the run recorded for that session, in order."""
    from .base import Limits, SessionContext, run_session
    from .claude import ClaudeAgent, ClaudeOptions

    rows: list[dict] = []
    task, evaluator = make()
    for path in sessions(op_dir):
        entries = read(path)
        start = next((e for e in entries if e.get("kind") == "session_start"), {})
        model = start.get("model") or "unknown"
        name = start.get("session") or "s0"
        context = SessionContext(index=int(start.get("index", 0)),
                                 count=int(start.get("count", 1)), name=name)
        opts = ClaudeOptions(model=model, max_turns=10_000, budget_usd=1e9, api_retries=0)
        agent = ClaudeAgent(opts, client=TranscriptClient(entries, model),
                            sleep=lambda s: None)
        where = out_dir / path.parent.relative_to(op_dir)
        result = run_session(agent, task, evaluator, where, Limits(max_candidates=10_000),
                             context=context)
        before = recorded(name) or [e["attempt"]["verdict"] for e in entries
                                    if e.get("kind") == "harness_feedback"]
        after = [a.verdict for a in result.attempts]
        for k in range(max(len(before), len(after))):
            old = before[k] if k < len(before) else None
            new = after[k] if k < len(after) else None
            att = result.attempts[k] if k < len(after) else None
            rows.append({"op": task.op, "session": name, "submission": k + 1,
                         "candidate": att.candidate if att else None, "recorded": old,
                         "replayed": new, "reproduced": old == new,
                         "replayed_reasons": list(att.reasons) if att else []})
    return rows


__all__ = ["NAME", "Transcript", "TranscriptClient", "TranscriptEnd", "read",
           "replay_sessions", "sessions"]
