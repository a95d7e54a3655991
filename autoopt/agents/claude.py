"""The Claude agent: a Messages API tool-use loop in which the harness answers `submit_variant`.

The model reads the contract, reference, current best, profile and numerics notes through tools,
and submits complete variant sources. Each `submit_variant` call ends `propose()` with a
`Proposal`; the loop has the harness verify and time it, and the verdict (with the rejection
reasons or the timings) goes back to the model as that call's tool result on the next
`propose(feedback)`. The model never judges its own work.

Every request, reply, tool result and API error is appended to `<workdir>/transcript.jsonl`.
The API key is read from `autoopt.env` only, handed to the SDK and never logged or written.
API errors: the SDK retries (`sdk_retries`, honouring retry-after headers), then this module
retries `api_retries` more times with exponential backoff, then the session ends cleanly with a
stop reason: nothing is registered for a session that never submitted.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoopt import env

from .base import PROMPTS, Feedback, OptimizationTask, Proposal, numerics_notes

DEFAULT_MODEL = "claude-sonnet-5-5"
# USD per million tokens (input, output), by model-name prefix; longest prefix wins. Cache writes
# cost 1.25x input, cache reads 0.1x input. The 5.x entries assume their tier's 4.5 prices (check
# the current price list); an unknown model is priced like Opus 4.1, the most expensive listed,
# so the budget errs on the side of stopping early.
PRICES: dict[str, tuple[float, float]] = {
    "claude-opus-5": (5.0, 25.0),
    "claude-sonnet-5": (3.0, 15.0),
    "claude-haiku-5": (1.0, 5.0),
    "claude-opus-4-5": (5.0, 25.0),
    "claude-opus-4-1": (15.0, 75.0),
    "claude-opus-4": (15.0, 75.0),
    "claude-sonnet-4": (3.0, 15.0),
    "claude-haiku-4-5": (1.0, 5.0),
}
_FALLBACK_PRICE = (15.0, 75.0)
RETRYABLE = {408, 409, 429, 500, 502, 503, 504, 529}
_MAX_TOOL_TEXT = 60_000


class MissingKeyError(RuntimeError):
    """No Anthropic API key: raised before any work is done."""


@dataclass(frozen=True)
class ClaudeOptions:
    model: str = DEFAULT_MODEL
    max_turns: int = 40  # API calls per op session
    max_tokens: int = 16_000  # per reply
    budget_usd: float = 10.0  # for the whole run (all sessions of this agent)
    sdk_retries: int = 2
    api_retries: int = 2
    backoff_s: float = 2.0
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_tokens < 1 or self.budget_usd <= 0:
            raise ValueError("max_turns, max_tokens and budget_usd must be positive")


def price(model: str) -> tuple[float, float]:
    best = max((p for p in PRICES if model.startswith(p)), key=len, default=None)
    return PRICES[best] if best else _FALLBACK_PRICE


def cost_usd(model: str, usage: Any) -> float:
    p_in, p_out = price(model)
    get = (lambda k: int(getattr(usage, k, 0) or 0)) if not isinstance(usage, dict) else (
        lambda k: int(usage.get(k) or 0))
    return (get("input_tokens") * p_in + get("output_tokens") * p_out
            + get("cache_creation_input_tokens") * p_in * 1.25
            + get("cache_read_input_tokens") * p_in * 0.1) / 1e6


def _schema(props: dict | None = None, required: tuple[str, ...] = ()) -> dict:
    return {"type": "object", "properties": props or {}, "required": list(required)}


TOOLS: list[dict] = [
    {"name": "read_contract", "description": "The op's signature, docstring, numerics policy, "
     "shapes and hardware.", "input_schema": _schema()},
    {"name": "read_reference", "description": "Source of the op's reference module (plain "
     "PyTorch; the single source of truth).", "input_schema": _schema()},
    {"name": "read_current_best", "description": "Source and evidence record of the variant "
     "currently selected for this op (the one to beat).", "input_schema": _schema()},
    {"name": "read_profile", "description": "The op's row of the target's profile (time, calls,"
     " kernels, bytes, floor, gap) and earlier attempts.", "input_schema": _schema()},
    {"name": "read_numerics_notes", "description": "Where the reference rounds, reduction "
     "orders, Triton facts that matter.", "input_schema": _schema()},
    {"name": "submit_variant", "description": "Submit a complete variant module. The harness "
     "verifies and times it; the result is its verdict with reasons or timings.",
     "input_schema": _schema({
         "source": {"type": "string", "description": "the whole Python module"},
         "name": {"type": "string", "description": "short name hint, e.g. rows4"},
         "notes": {"type": "string", "description": "hypothesis -> prediction"},
         "config": {"type": "object", "description": "optional config passed to run()"},
     }, ("source",))},
    {"name": "finish", "description": "End the session.",
     "input_schema": _schema({"summary": {"type": "string"}})},
]

READERS: dict[str, Callable[[OptimizationTask], str]] = {
    "read_contract": lambda t: t.contract_text(),
    "read_reference": lambda t: t.reference_source,
    "read_current_best": lambda t: (f"current selection: {t.current_name}\n\n{t.current_source}"
                                    f"\n\nrecord:\n{json.dumps(t.current_record, indent=1)}"),
    "read_profile": lambda t: f"{t.profile_text()}\n\nearlier attempts:\n{t.history_text()}",
    "read_numerics_notes": lambda t: numerics_notes(),
}


class ClaudeAgent:
    """Agent factory; holds the client and the run-wide cost."""

    name = "claude"

    def __init__(self, options: ClaudeOptions | None = None, *, sleep: Callable = time.sleep,
                 **overrides: Any) -> None:
        self.options = options or ClaudeOptions(**overrides)
        key = env.anthropic_api_key()
        if not key:
            raise MissingKeyError(
                "the claude agent needs an Anthropic API key and ANTHROPIC_API_KEY is not set; "
                "export ANTHROPIC_API_KEY=... (and ANTHROPIC_BASE_URL for another endpoint), or "
                "use the offline template agent: --agent template")
        try:
            import anthropic
        except ImportError as e:  # pragma: no cover - a declared dependency
            raise MissingKeyError(f"the claude agent needs the anthropic package ({e}); "
                                  "pip install anthropic") from None
        self._anthropic = anthropic
        self.client = anthropic.Anthropic(
            api_key=key, base_url=env.anthropic_base_url(),
            max_retries=self.options.sdk_retries, timeout=self.options.timeout_s)
        self.spent_usd = 0.0
        self.sleep = sleep

    def supports(self, op: str) -> bool:
        return True  # any op contract: the model writes the kernel

    def start(self, task: OptimizationTask, evaluator: Any, workdir: Path,
              limits: Any = None) -> ClaudeSession:
        return ClaudeSession(self, task, Path(workdir))


class Transcript:
    """Append-only JSONL of everything said in a session (never the key: it is not in here)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, kind: str, **data: Any) -> None:
        entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "kind": kind, **data}
        with self.path.open("a") as f:
            f.write(json.dumps(entry, default=str) + "\n")


def _first_message(task: OptimizationTask) -> str:
    return (f"Optimize the op `{task.op}` on {task.hardware.get('gpu', task.device)} "
            f"(device {task.device}).\nSignature: {task.signature}\nNumerics: "
            f"{task.numerics_policy}\nCurrent selection: {task.current_name}\n"
            f"{task.profile_text()}\nEarlier attempts:\n{task.history_text()}\n\n"
            "Read what you need with the read_* tools, then submit_variant. Call finish when "
            "done.")


def _tool_result(tool_id: str, text: str, error: bool = False) -> dict:
    if len(text) > _MAX_TOOL_TEXT:
        text = text[:_MAX_TOOL_TEXT] + f"\n[truncated at {_MAX_TOOL_TEXT} characters]"
    return {"type": "tool_result", "tool_use_id": tool_id, "content": text, "is_error": error}


class ClaudeSession:
    def __init__(self, agent: ClaudeAgent, task: OptimizationTask, workdir: Path) -> None:
        self.agent, self.task, self.opts = agent, task, agent.options
        self.system = (PROMPTS / "system.md").read_text()
        first = _first_message(task)
        self.prompt_hash = hashlib.sha256((self.system + first).encode()).hexdigest()[:16]
        self.messages: list[dict] = [{"role": "user", "content": first}]
        self.pending: list[dict] = []
        self.submit_id: str | None = None
        self.turns = 0
        self.usage = {"input_tokens": 0, "output_tokens": 0}
        self.cost = 0.0
        self.stop_reason: str | None = None
        self.log = Transcript(workdir / "transcript.jsonl")
        self.log.write("session_start", op=task.op, model=self.opts.model, system=self.system,
                       tools=TOOLS, prompt_hash=self.prompt_hash)
        self._logged = 0

    # ---- the loop ---------------------------------------------------------------------------
    def propose(self, feedback: Feedback | None) -> Proposal | None:
        if feedback is not None and self.submit_id is not None:
            failed = feedback.attempt.verdict != "pass"
            self.log.write("harness_feedback", tool_use_id=self.submit_id,
                           attempt=feedback.attempt.to_dict())
            self.pending.insert(0, _tool_result(self.submit_id, feedback.to_text(), failed))
            self.submit_id = None
        while self.stop_reason is None:
            if self.pending:
                self.messages.append({"role": "user", "content": self.pending})
                self.pending = []
            reply = self._call()
            if reply is None:
                return None
            proposal = self._handle(reply)
            if proposal is not None:
                return proposal
        return None

    def _handle(self, reply: Any) -> Proposal | None:
        content = [b.model_dump(exclude_none=True) for b in reply.content]
        self.messages.append({"role": "assistant", "content": content})
        proposal = None
        for block in reply.content:
            if block.type != "tool_use":
                continue
            args = block.input if isinstance(block.input, dict) else {}
            if block.name == "submit_variant" and proposal is None and args.get("source"):
                proposal, self.submit_id = self._proposal(args), block.id
            elif block.name == "submit_variant":
                why = ("submit_variant needs a non-empty `source`" if not args.get("source") else
                       "only one submit_variant per reply is evaluated; submit it again")
                self.pending.append(_tool_result(block.id, why, True))
            elif block.name == "finish":
                self.stop_reason = "agent called finish"
                self.pending.append(_tool_result(block.id, "session finished"))
            elif block.name in READERS:
                self.pending.append(_tool_result(block.id, READERS[block.name](self.task)))
            else:
                self.pending.append(_tool_result(block.id, f"unknown tool {block.name!r}", True))
        for r in self.pending:
            self.log.write("tool_result", **r)
        if proposal is None and self.stop_reason is None and reply.stop_reason != "tool_use":
            self.stop_reason = f"model ended its turn without a tool call ({reply.stop_reason})"
        return proposal

    def _proposal(self, args: dict) -> Proposal:
        return Proposal(source=str(args["source"]), name_hint=str(args.get("name") or "v"),
                        notes=str(args.get("notes") or ""),
                        config=args.get("config") if isinstance(args.get("config"), dict)
                        else None,
                        meta={"agent": "claude", "model": self.opts.model,
                              "prompt_hash": self.prompt_hash, "turn": self.turns})

    # ---- the API ----------------------------------------------------------------------------
    def _call(self) -> Any | None:
        if self.turns >= self.opts.max_turns:
            self.stop_reason = f"max turns ({self.opts.max_turns}) reached"
            return None
        if self.agent.spent_usd >= self.opts.budget_usd:
            self.stop_reason = (f"cost budget spent (${self.agent.spent_usd:.2f} of "
                                f"${self.opts.budget_usd:.2f})")
            return None
        self.log.write("request", turn=self.turns + 1, new_messages=self.messages[self._logged:])
        self._logged = len(self.messages)
        api = self.agent._anthropic
        for attempt in range(self.opts.api_retries + 1):
            try:
                reply = self.agent.client.messages.create(
                    model=self.opts.model, max_tokens=self.opts.max_tokens,
                    system=[{"type": "text", "text": self.system,
                             "cache_control": {"type": "ephemeral"}}],
                    tools=TOOLS, messages=self.messages)
            except (api.APIStatusError, api.APIConnectionError) as e:
                status = getattr(e, "status_code", None)
                self.log.write("api_error", status=status, error=type(e).__name__,
                               message=str(e)[:1000], attempt=attempt + 1)
                retryable = status is None or status in RETRYABLE
                if not retryable or attempt == self.opts.api_retries:
                    self.stop_reason = (f"API error {status or type(e).__name__} after "
                                        f"{attempt + 1} attempt(s): {str(e)[:200]}")
                    return None
                self.agent.sleep(self.opts.backoff_s * 2**attempt)
                continue
            self._account(reply)
            return reply
        return None  # pragma: no cover - the loop always returns

    def _account(self, reply: Any) -> None:
        self.turns += 1
        spent = cost_usd(self.opts.model, reply.usage)
        self.cost += spent
        self.agent.spent_usd += spent
        for k in self.usage:
            self.usage[k] += int(getattr(reply.usage, k, 0) or 0)
        self.log.write("response", turn=self.turns, stop_reason=reply.stop_reason,
                       content=[b.model_dump(exclude_none=True) for b in reply.content],
                       usage=reply.usage.model_dump(exclude_none=True), cost_usd=spent)

    def close(self) -> dict:
        summary = {"stop_reason": self.stop_reason, "turns": self.turns, "usage": self.usage,
                   "cost_usd": round(self.cost, 6), "model": self.opts.model,
                   "prompt_hash": self.prompt_hash}
        self.log.write("session_end", **summary)
        return summary
