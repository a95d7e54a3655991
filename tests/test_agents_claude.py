"""The Claude agent end to end: the real `anthropic` SDK against a scripted server on loopback,
with the real harness (sandboxed verification, timing) on a temporary registry."""

from __future__ import annotations

import json

import pytest

from autoopt.agents import Limits, make_agent, run_session
from autoopt.agents.claude import DEFAULT_MODEL, ClaudeOptions, MissingKeyError, cost_usd
from autoopt.agents.template import CATALOG

from .agents_support import ScriptedAnthropic, error, harness, message, registry_files, tool_use

SECRET = "sk-ant-test-DO-NOT-WRITE-0123456789"

# A Triton kernel that cannot compile: tl.arange needs a power-of-two range.
NOT_COMPILING = '''
import torch
import triton
import triton.language as tl


@triton.jit
def _k(g, u, o, n):
    offs = tl.arange(0, 100)
    tl.store(o + offs, tl.load(g + offs, mask=offs < n), mask=offs < n)


def run(gate, up, config=None):
    out = torch.empty_like(gate)
    _k[(1,)](gate, up, out, gate.numel())
    return out
'''

# Cheating: hands the reference's own result back.
CHEATING = '''
from model.ops.swiglu import reference


def run(gate, up, config=None):
    return reference(gate, up).clone()
'''


@pytest.fixture
def api_env(monkeypatch):
    def point_at(server: ScriptedAnthropic) -> None:
        monkeypatch.setenv("ANTHROPIC_API_KEY", SECRET)
        monkeypatch.setenv("ANTHROPIC_BASE_URL", server.url)

    return point_at


def _options(**kw) -> ClaudeOptions:
    return ClaudeOptions(**{"sdk_retries": 2, "api_retries": 2, "backoff_s": 0.001,
                            "max_turns": 12, **kw})


def test_session_rejects_broken_and_cheating_then_registers_the_correct_one(tmp_path, api_env):
    correct = CATALOG["swiglu"][0].render()
    script = [
        message(tool_use("read_contract"), tool_use("read_numerics_notes")),
        message(tool_use("submit_variant", source=NOT_COMPILING, name="arange100",
                         notes="hypothesis: one program")),
        message(tool_use("submit_variant", source=CHEATING, name="shortcut")),
        message(tool_use("submit_variant", source=correct, name="tiles",
                         notes="hypothesis: tiles", config={"ROWS": 8, "BLOCK": 256,
                                                            "num_warps": 2})),
        message(tool_use("finish", summary="done"), stop_reason="tool_use"),
    ]
    ctx, task, evaluator, recorded = harness(tmp_path, "swiglu")
    with ScriptedAnthropic(script) as server:
        api_env(server)
        agent = make_agent("claude", options=_options())
        result = run_session(agent, task, evaluator, ctx.run_dir / "ops" / "swiglu",
                             Limits(max_candidates=5))
    verdicts = [a.verdict for a in result.attempts]
    assert verdicts == ["reject", "reject", "pass"], [a.reasons for a in result.attempts]
    assert result.stop_reason == "agent called finish"
    # Exactly the correct one is registered.
    assert ctx.registry.variants("swiglu") == ["claude_tiles_v1"]
    rec = ctx.registry.read_record("swiglu", "claude_tiles_v1")
    assert rec.status == "candidate" and rec.provenance.agent == "claude"
    assert rec.provenance.model == DEFAULT_MODEL and rec.provenance.prompt_sha256
    # On the CPU nothing is timed: the config it was verified with is not proposed as tuned.
    assert not rec.proposed_configs and not rec.benchmarks
    ver = rec.verification["cpu"][0]
    assert ver.verdict == "pass" and ver.config == {"ROWS": 8, "BLOCK": 256, "num_warps": 2}
    # Both failures are recorded with reasons, and the reasons went back to the model.
    broken, cheat = result.attempts[0], result.attempts[1]
    assert broken.reasons and cheat.reasons
    assert any("reference" in r for r in cheat.reasons), cheat.reasons
    assert len(server.requests) == 5
    sent = {i: server.tool_results(i) for i in range(1, 5)}
    assert {r["tool_use_id"] for r in sent[1]} == {b["id"] for b in script[0]["content"]}
    assert "swiglu(gate[T,I] bf16" in json.dumps(sent[1])
    first, second, third = sent[2][0], sent[3][0], sent[4][0]
    assert first["is_error"] and broken.reasons[0][:60] in first["content"]
    assert second["is_error"] and cheat.reasons[0][:60] in second["content"]
    assert not third["is_error"] and "pass" in third["content"]
    assert [a.verdict for _, a, _ in recorded] == verdicts
    # The transcript has every request, reply and tool result, and never the key.
    transcript = (ctx.run_dir / "ops" / "swiglu" / "transcript.jsonl").read_text()
    kinds = [json.loads(line)["kind"] for line in transcript.splitlines()]
    assert kinds.count("request") == 5 and kinds.count("response") == 5
    assert kinds.count("harness_feedback") == 3
    for path in registry_files(tmp_path):
        assert SECRET not in path.read_text(errors="ignore"), path
    # The SDK did send the key (as x-api-key or a bearer token, depending on its version).
    for h in server.headers:
        low = {k.lower(): v for k, v in h.items()}
        assert SECRET in (low.get("x-api-key"), low.get("authorization", "")[7:])


@pytest.mark.parametrize("statuses", [[429, 500, 529]], ids=["429-500-529"])
def test_api_errors_are_retried_then_end_the_session_cleanly(tmp_path, api_env, statuses):
    ctx, task, evaluator, _ = harness(tmp_path, "swiglu")
    replies = [error(s) for s in statuses] * 3
    sleeps: list[float] = []
    with ScriptedAnthropic(replies) as server:
        api_env(server)
        agent = make_agent("claude", options=_options(), sleep=sleeps.append)
        result = run_session(agent, task, evaluator, ctx.run_dir / "ops" / "swiglu",
                             Limits(max_candidates=3))
    # SDK: 1 + 2 retries per call; ours: 1 + 2 calls; every status was seen.
    assert len(server.requests) == 9
    assert set(server.statuses) == set(statuses)
    assert sleeps == [0.001, 0.002]  # bounded exponential backoff between our retries
    assert result.attempts == [] and "API error" in result.stop_reason
    assert registry_files(ctx.registry.root) == []
    log = (ctx.run_dir / "ops" / "swiglu" / "transcript.jsonl").read_text()
    assert log.count('"kind": "api_error"') == 3
    assert SECRET not in log


def test_transient_overload_is_retried_and_the_session_goes_on(tmp_path, api_env):
    ctx, task, evaluator, _ = harness(tmp_path, "swiglu")
    script = [error(529), error(429), message(tool_use("read_profile")),
              message(tool_use("finish"))]
    with ScriptedAnthropic(script) as server:
        api_env(server)
        agent = make_agent("claude", options=_options())
        result = run_session(agent, task, evaluator, ctx.run_dir / "ops" / "swiglu",
                             Limits(max_candidates=3))
    assert server.statuses == [529, 429, 200, 200]
    assert result.stop_reason == "agent called finish"
    assert "profile row" in server.tool_results(3)[0]["content"]


def test_missing_key_fails_before_any_work(tmp_path, monkeypatch):
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    with pytest.raises(MissingKeyError, match="ANTHROPIC_API_KEY"):
        make_agent("claude")
    from autoopt.loop import OptimizeArgs, optimize

    runs = tmp_path / "runs"
    with pytest.raises(MissingKeyError, match="--agent template"):
        optimize(OptimizeArgs(target="cpu-tiny", agent="claude", runs_dir=str(runs),
                              registry=str(tmp_path / "reg")))
    assert not runs.exists()  # no run directory, no profile: nothing was done


def test_cost_budget_stops_the_session(tmp_path, api_env):
    ctx, task, evaluator, _ = harness(tmp_path, "swiglu")
    with ScriptedAnthropic([message(tool_use("read_profile"))], repeat_last=True) as server:
        api_env(server)
        # 1000 in + 200 out tokens at Sonnet prices is $0.006 a reply: the budget allows 2.
        agent = make_agent("claude", options=_options(budget_usd=0.01))
        result = run_session(agent, task, evaluator, ctx.run_dir / "ops" / "swiglu",
                             Limits(max_candidates=3))
    assert len(server.requests) == 2
    assert "cost budget" in result.stop_reason
    assert cost_usd("claude-sonnet-5-5", {"input_tokens": 10**6}) == pytest.approx(3.0)
    assert cost_usd("unknown-model", {"output_tokens": 10**6}) == pytest.approx(75.0)
