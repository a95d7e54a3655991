"""The Claude agent: a Messages API tool-use loop in which the harness answers the tools.

The model reads the contract, reference, current best, any registered variant, the profile and
the numerics notes through tools; checks a module at one small shape (`check_candidate`: the
compiler's error or the first mismatches, not a submission); asks for Nsight Compute metrics of
its last verified submission (`profile_candidate`); and submits complete variant sources in
Triton or CuTe DSL (`submit_variant`, the language declared per submission; tools.py). Each
`submit_variant` ends `propose()` with a `Proposal`; the loop has the harness verify and time
it, and the verdict (the rejection reasons, or the time per shape against the baseline, the
reference and the floor) goes back as that call's tool result on the next `propose(feedback)`.
The model never judges its own work.

Sessions of one op run at once on threads and share the agent, so the run's cost budget is
shared: before each call the spend so far plus the calls in flight (each counted at the largest
reply seen) must be under `budget_usd`; the budget can be passed by at most one reply per
session running at once. Usage (input, output, cache writes and reads) is priced per model
(`PRICES`) and reported to the run's ledger as each reply arrives.

Every request, reply, tool result and API error is appended to `<workdir>/transcript.jsonl`;
`transcript.py` replays a session from it without a key. The API key is read from `autoopt.env`
only, handed to the SDK and never logged or written. API errors: the SDK retries
(`sdk_retries`, honouring retry-after headers), then this module retries `api_retries` more
times with exponential backoff, then the session ends cleanly with a stop reason: nothing is
registered for a session that never submitted.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoopt import env

from .base import PROMPTS, Feedback, OptimizationTask, Proposal, SessionContext
from .tools import TOOLS, answer, clip, proposal_from
from .transcript import Transcript, TranscriptEnd

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
USAGE_FIELDS = ("input_tokens", "output_tokens", "cache_creation_input_tokens",
                "cache_read_input_tokens")
# Sessions of one op start from different places (session k takes strategy k mod len).
STRATEGIES = (
    "Start from the current best (read_current_best, read_variant) and remove the largest cost "
    "the profile shows; check_candidate before you submit.",
    "Design a new fused kernel from the contract and the memory-traffic floor, not from the "
    "current best; check_candidate before you submit.",
    "Tune the launch: tile sizes, warps, stages, split-K and the grid per token bucket "
    "(CONFIG_SPACE); profile_candidate after each verified submission to see what limits it.",
    "On a GPU target, write it in CuTe DSL (LANGUAGE = \"cute\", precompile(arch) for the "
    "compile check); elsewhere, a Triton kernel that minimises DRAM traffic.",
)


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


class Spend:
    """The run's spend on the API, shared by the sessions running at once (thread-safe)."""

    def __init__(self, budget_usd: float, already: float = 0.0) -> None:
        self.budget, self.spent = budget_usd, already
        self.in_flight, self.largest = 0, 0.0
        self._lock = threading.Lock()

    def reserve(self) -> str | None:
        """None: go ahead (one call now in flight); else why the budget is spent."""
        with self._lock:
            if self.spent + self.in_flight * self.largest >= self.budget:
                return (f"cost budget spent (${self.spent:.2f} of ${self.budget:.2f}"
                        + (f", {self.in_flight} call(s) in flight" if self.in_flight else "")
                        + ")")
            self.in_flight += 1
            return None

    def settle(self, usd: float | None) -> None:
        """A reserved call ended (None: it failed and cost nothing)."""
        with self._lock:
            self.in_flight -= 1
            if usd is not None:
                self.spent += usd
                self.largest = max(self.largest, usd)


class ClaudeAgent:
    """Agent factory; holds the client and the run-wide spend."""

    name = "claude"

    def __init__(self, options: ClaudeOptions | None = None, *, sleep: Callable = time.sleep,
                 client: Any = None, **overrides: Any) -> None:
        self.options = options or ClaudeOptions(**overrides)
        try:
            import anthropic
        except ImportError as e:  # pragma: no cover - a declared dependency
            raise MissingKeyError(f"the claude agent needs the anthropic package ({e}); "
                                  "pip install anthropic") from None
        self._anthropic = anthropic
        if client is None:  # a replay hands its transcript's client and needs no key
            key = env.anthropic_api_key()
            if not key:
                raise MissingKeyError(
                    "the claude agent needs an Anthropic API key and ANTHROPIC_API_KEY is not "
                    "set; export ANTHROPIC_API_KEY=... (and ANTHROPIC_BASE_URL for another "
                    "endpoint), or use the offline template agent: --agent template")
            client = anthropic.Anthropic(
                api_key=key, base_url=env.anthropic_base_url(),
                max_retries=self.options.sdk_retries, timeout=self.options.timeout_s)
        self.client = client
        self.spend = Spend(self.options.budget_usd)
        self._seeded = False
        self.sleep = sleep

    @property
    def spent_usd(self) -> float:
        return self.spend.spent

    def supports(self, op: str) -> bool:
        return True  # any op contract: the model writes the kernel

    def start(self, task: OptimizationTask, evaluator: Any, workdir: Path,
              limits: Any = None, context: SessionContext | None = None) -> ClaudeSession:
        context = context or SessionContext()
        if context.ledger is not None and not self._seeded:
            # A resumed run: what earlier sessions spent counts against the same budget.
            self.spend.spent = max(self.spend.spent, context.ledger.usd())
            self._seeded = True
        return ClaudeSession(self, task, evaluator, Path(workdir), context)


def _first_message(task: OptimizationTask, context: SessionContext) -> str:
    text = (f"Optimize the op `{task.op}` on {task.hardware.get('gpu', task.device)} "
            f"(device {task.device}).\nSignature: {task.signature}\nNumerics: "
            f"{task.numerics_policy}\nCurrent selection: {task.current_name}\n"
            f"{task.profile_text()}\nEarlier attempts:\n{task.history_text()}\n\n"
            "Read what you need with the read_* tools, check_candidate a module at one small "
            "shape, then submit_variant (Triton or CuTe DSL, declared with `language`). Call "
            "finish when done.")
    if context.count > 1:
        text += (f"\n\nYou are session {context.index + 1} of {context.count} on this op; "
                 f"the others work at the same time. Your approach: "
                 f"{STRATEGIES[context.index % len(STRATEGIES)]}")
    return text


def _tool_result(tool_id: str, text: str, error: bool = False) -> dict:
    return {"type": "tool_result", "tool_use_id": tool_id, "content": clip(text),
            "is_error": error}


class ClaudeSession:
    def __init__(self, agent: ClaudeAgent, task: OptimizationTask, evaluator: Any,
                 workdir: Path, context: SessionContext) -> None:
        self.agent, self.task, self.opts = agent, task, agent.options
        self.evaluator, self.context = evaluator, context
        self.system = (PROMPTS / "system.md").read_text()
        first = _first_message(task, context)
        self.prompt_hash = hashlib.sha256((self.system + first).encode()).hexdigest()[:16]
        self.messages: list[dict] = [{"role": "user", "content": first}]
        self.pending: list[dict] = []
        self.submitted: tuple[str, Proposal] | None = None  # (tool_use id, proposal)
        self.last_pass: Proposal | None = None
        self.turns = 0
        self.usage = dict.fromkeys(USAGE_FIELDS, 0)
        self.cost = 0.0
        self.stop_reason: str | None = None
        self.log = Transcript(workdir / "transcript.jsonl")
        self.log.write("session_start", op=task.op, model=self.opts.model, system=self.system,
                       tools=TOOLS, prompt_hash=self.prompt_hash, session=context.name,
                       index=context.index, count=context.count)
        self._logged = 0

    # ---- the loop ---------------------------------------------------------------------------
    def propose(self, feedback: Feedback | None) -> Proposal | None:
        if feedback is not None and self.submitted is not None:
            tool_id, proposal = self.submitted
            failed = feedback.attempt.verdict != "pass"
            if not failed:
                self.last_pass = proposal
            self.log.write("harness_feedback", tool_use_id=tool_id,
                           attempt=feedback.attempt.to_dict())
            self.pending.insert(0, _tool_result(tool_id, feedback.to_text(), failed))
            self.submitted = None
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

    def _meta(self) -> dict:
        return {"agent": "claude", "model": self.opts.model, "prompt_hash": self.prompt_hash,
                "turn": self.turns, "session": self.context.name}

    def _handle(self, reply: Any) -> Proposal | None:
        content = [b.model_dump(exclude_none=True) for b in reply.content]
        self.messages.append({"role": "assistant", "content": content})
        proposal = None
        for block in reply.content:
            if block.type != "tool_use":
                continue
            args = block.input if isinstance(block.input, dict) else {}
            if block.name == "submit_variant":
                if proposal is not None:
                    self.pending.append(_tool_result(
                        block.id, "only one submit_variant per reply is evaluated; submit it "
                        "again", True))
                    continue
                proposal, err = proposal_from(args, self._meta())
                if err:
                    self.pending.append(_tool_result(block.id, err, True))
                else:
                    self.submitted = (block.id, proposal)
            elif block.name == "finish":
                self.stop_reason = "agent called finish"
                self.pending.append(_tool_result(block.id, "session finished"))
            else:
                text, error = self._answer(block.name, args)
                self.pending.append(_tool_result(block.id, text, error))
        for r in self.pending:
            self.log.write("tool_result", **r)
        if proposal is None and self.stop_reason is None and reply.stop_reason != "tool_use":
            self.stop_reason = f"model ended its turn without a tool call ({reply.stop_reason})"
        return proposal

    def _answer(self, name: str, args: dict) -> tuple[str, bool]:
        try:
            return answer(name, args, self.task, self.evaluator, self.last_pass, self._meta())
        except Exception as e:  # noqa: BLE001 - a harness failure is the tool's error result
            return f"the harness could not answer {name}: {type(e).__name__}: {e}", True

    # ---- the API ----------------------------------------------------------------------------
    def _call(self) -> Any | None:
        if self.turns >= self.opts.max_turns:
            self.stop_reason = f"max turns ({self.opts.max_turns}) reached"
            return None
        why = self.agent.spend.reserve()
        if why is not None:
            self.stop_reason = why
            return None
        reply = None
        try:
            reply = self._request()
        finally:
            usd = cost_usd(self.opts.model, reply.usage) if reply is not None else None
            self.agent.spend.settle(usd)
        if reply is not None:
            self._account(reply, usd or 0.0)
        return reply

    def _request(self) -> Any | None:
        self.log.write("request", turn=self.turns + 1, new_messages=self.messages[self._logged:])
        self._logged = len(self.messages)
        api = self.agent._anthropic
        for attempt in range(self.opts.api_retries + 1):
            try:
                return self.agent.client.messages.create(
                    model=self.opts.model, max_tokens=self.opts.max_tokens,
                    system=[{"type": "text", "text": self.system,
                             "cache_control": {"type": "ephemeral"}}],
                    tools=TOOLS, messages=self.messages)
            except TranscriptEnd as e:
                self.stop_reason = str(e)
                return None
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
        return None  # pragma: no cover - the loop always returns

    def _account(self, reply: Any, spent: float) -> None:
        self.turns += 1
        self.cost += spent
        usage = reply.usage.model_dump(exclude_none=True)
        for k in self.usage:
            self.usage[k] += int(usage.get(k) or 0)
        if self.context.ledger is not None:
            self.context.ledger.api_call(self.context.name, self.opts.model, usage, spent)
        self.log.write("response", turn=self.turns, stop_reason=reply.stop_reason,
                       content=[b.model_dump(exclude_none=True) for b in reply.content],
                       usage=usage, cost_usd=spent, model=getattr(reply, "model", None))

    def close(self) -> dict:
        summary = {"stop_reason": self.stop_reason, "turns": self.turns, "usage": self.usage,
                   "cost_usd": round(self.cost, 6), "model": self.opts.model,
                   "prompt_hash": self.prompt_hash}
        self.log.write("session_end", **summary)
        return summary
