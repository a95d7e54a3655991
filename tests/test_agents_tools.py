"""The Claude agent's tools against the scripted Anthropic-compatible server, with the real
harness: check_candidate (compile errors, mismatches), profile_candidate (the plain no-GPU
message on a CPU), read_variant, CuTe DSL submissions routed to the CuTe compile check, two
sessions at once sharing one budget, and a session replayed from its transcript without a key."""

from __future__ import annotations

import json

import pytest

from autoopt.agents import Limits, SessionContext, make_agent, run_session
from autoopt.agents.claude import ClaudeOptions
from autoopt.agents.template import CATALOG
from autoopt.budget import Ledger

from .agents_support import ScriptedAnthropic, harness, message, tool_use
from .test_agents_claude import NOT_COMPILING, SECRET

# SiLU rounded to BF16 before the product: a second rounding the contract does not have.
TWO_ROUNDINGS = '''import torch


def run(gate, up, config=None):
    g = gate.float()
    s = (g * torch.sigmoid(g)).to(torch.bfloat16)
    return (s * up).contiguous()
'''

CUTE_WITHOUT_DECLARATION = "import torch\n\n\ndef run(gate, up, config=None):\n    return gate\n"


@pytest.fixture
def api_env(monkeypatch):
    def point_at(server: ScriptedAnthropic) -> None:
        monkeypatch.setenv("ANTHROPIC_API_KEY", SECRET)
        monkeypatch.setenv("ANTHROPIC_BASE_URL", server.url)

    return point_at


def _options(**kw) -> ClaudeOptions:
    return ClaudeOptions(**{"sdk_retries": 0, "api_retries": 0, "backoff_s": 0.001,
                            "max_turns": 12, **kw})


def test_check_profile_and_read_variant_are_answered_by_the_harness(tmp_path, api_env):
    correct = CATALOG["swiglu"][0].render()
    cfg = {"ROWS": 8, "BLOCK": 256, "num_warps": 2}
    script = [
        message(tool_use("check_candidate", source=NOT_COMPILING),
                tool_use("check_candidate", source=TWO_ROUNDINGS, tokens=3),
                tool_use("profile_candidate"), tool_use("read_variant", variant="nope")),
        message(tool_use("submit_variant", source=correct, name="tiles", config=cfg)),
        message(tool_use("profile_candidate"),
                tool_use("check_candidate", source=correct, config=cfg)),
        message(tool_use("finish")),
    ]
    ctx, task, evaluator, _ = harness(tmp_path, "swiglu")
    with ScriptedAnthropic(script) as server:
        api_env(server)
        agent = make_agent("claude", options=_options())
        result = run_session(agent, task, evaluator, ctx.run_dir / "ops" / "swiglu",
                             Limits(max_candidates=3))
    assert [a.verdict for a in result.attempts] == ["pass"]  # checks are not submissions
    broken, wrong, early, unknown = server.tool_results(1)
    assert broken["is_error"] is False and "failed when called" in broken["content"]
    assert "arange" in broken["content"]  # the compiler's own complaint
    assert "does NOT match" in wrong["content"] and "T': 3" in wrong["content"]
    assert "elements differ bitwise" in wrong["content"] and "got " in wrong["content"]
    assert early["is_error"] and "no verified submission yet" in early["content"]
    assert unknown["is_error"] and "no registered variant swiglu/nope" in unknown["content"]
    verdict = server.tool_results(2)[0]
    assert "pass" in verdict["content"] and "CPU: verified only" in verdict["content"]
    profile, check = server.tool_results(3)
    assert not profile["is_error"] and "no GPU" in profile["content"]
    assert "matches the reference" in check["content"]
    assert len(list((ctx.run_dir / "ops" / "swiglu" / "candidates").glob("*.py"))) == 1


def test_cute_submissions_are_routed_to_the_cute_compile_check(tmp_path, api_env, monkeypatch):
    from model.registry import cute

    compiled = []

    def check(path, arch="sm_90a", timeout=600.0):
        compiled.append(arch)
        return ["DSLRuntimeError: tensor layout mismatch at line 9"]

    monkeypatch.setattr(cute, "check_compiles", check)
    cute_source = 'LANGUAGE = "cute"\n' + CUTE_WITHOUT_DECLARATION
    script = [
        message(tool_use("submit_variant", source=CUTE_WITHOUT_DECLARATION, language="cute")),
        message(tool_use("submit_variant", source=cute_source, language="cute")),
        message(tool_use("check_candidate", source=cute_source, language="cute"),
                tool_use("check_candidate", source=cute_source, language="fortran")),
        message(tool_use("finish")),
    ]
    ctx, task, evaluator, _ = harness(tmp_path, "swiglu")
    with ScriptedAnthropic(script) as server:
        api_env(server)
        agent = make_agent("claude", options=_options())
        result = run_session(agent, task, evaluator, ctx.run_dir / "ops" / "swiglu",
                             Limits(max_candidates=3))
    undeclared, failed = result.attempts
    assert undeclared.verdict == "reject" and "LANGUAGE = 'triton'" in undeclared.reasons[0]
    assert failed.verdict == "reject" and failed.reasons[0].startswith(
        "CuTe DSL compile for sm_90a failed")
    assert compiled == ["sm_90", "sm_90"]  # the submission, then the check
    check, bad = server.tool_results(3)
    assert "does not compile" in check["content"] and "layout mismatch" in check["content"]
    assert bad["is_error"] and "one of triton, cute" in bad["content"]
    assert ctx.registry.variants("swiglu") == []


def test_two_sessions_at_once_share_one_cost_budget(tmp_path, api_env):
    """Two sessions of one op on threads, one agent: the run's budget is theirs together, and
    the ledger has each session's calls, tokens and USD from the API's usage fields."""
    import threading

    ctx, task, evaluator, _ = harness(tmp_path, "swiglu")
    ledger = Ledger()
    results = {}
    with ScriptedAnthropic([message(tool_use("read_profile"))], repeat_last=True) as server:
        api_env(server)
        # 1000 in + 200 out tokens at Sonnet prices is $0.006 a reply.
        agent = make_agent("claude", options=_options(budget_usd=0.03, max_turns=50))

        def one(k: int) -> None:
            context = SessionContext(index=k, count=2, name=f"swiglu/s{k}", ledger=ledger)
            results[k] = run_session(agent, task, evaluator, ctx.run_dir / "ops" / f"s{k}",
                                     Limits(max_candidates=3), context=context)

        threads = [threading.Thread(target=one, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert all("cost budget spent" in r.stop_reason for r in results.values())
    t = ledger.totals()
    assert t["calls"] == len(server.requests) and t["input_tokens"] == 1000 * t["calls"]
    assert t["usd"] == pytest.approx(0.006 * t["calls"])
    # Stopped at the budget, passing it by at most one reply per session at once.
    assert 0.03 <= t["usd"] + 0.006 and t["usd"] <= 0.03 + 2 * 0.006
    assert set(ledger.api) == {"swiglu/s0", "swiglu/s1"}
    assert sum(r.summary["turns"] for r in results.values()) == t["calls"]
    assert agent.spent_usd == pytest.approx(t["usd"])
    first = server.requests[0]["messages"][0]["content"]
    assert "session 1 of 2" in first or "session 2 of 2" in first


@pytest.mark.slow
def test_replay_reproduces_a_claude_sessions_verdicts_without_a_key(tmp_path, api_env,
                                                                     monkeypatch):
    from autoopt import loop
    from autoopt.replay import replay
    from autoopt.runstate import RunState
    from autoopt.targets import load_target

    correct = CATALOG["swiglu"][0].render()
    script = [
        message(tool_use("check_candidate", source=TWO_ROUNDINGS)),
        message(tool_use("submit_variant", source=TWO_ROUNDINGS, name="rounded")),
        message(tool_use("submit_variant", source=correct, name="tiles")),
        message(tool_use("finish")),
    ]
    args = loop.OptimizeArgs(target="cpu-tiny", agent="claude", registry=str(tmp_path / "reg"),
                             runs_dir=str(tmp_path / "runs"), verify_seeds=1,
                             verify_tokens=(5,), e2e=False)
    st = RunState.create(tmp_path / "runs" / "run", {**args.__dict__, "agent": "claude"},
                         "cpu-tiny")
    st.update(profile={"rows": [], "meaningful": False})
    st.set_ops([{"op": "swiglu", "time_us": 10.0, "floor_us": 1.0, "gap_us": 9.0}])
    ctx = loop._context(args, load_target("cpu-tiny"), st.run_dir, None)
    with ScriptedAnthropic(script) as server:
        api_env(server)
        agent = make_agent("claude", options=_options())
        loop._one_op(args, agent, ctx, st, "swiglu", 1e12, loop.Console(), 2e12)
    st.reload()
    recorded = [json.loads(x)["attempt"]["verdict"] for x in
                (st.run_dir / "attempts.jsonl").read_text().splitlines()]
    assert recorded == ["reject", "pass"]
    assert st.data["costs"]["api"]["swiglu/s0"]["calls"] == 4
    monkeypatch.delenv("ANTHROPIC_API_KEY")
    monkeypatch.setenv("ANTHROPIC_BASE_URL", "http://127.0.0.1:9")  # nothing listens
    out, same = replay(st.run_dir, runs_dir=str(tmp_path / "replays"))
    data = json.loads((out / "replay.json").read_text())
    assert same and [r["replayed"] for r in data["rows"]] == ["reject", "pass"]
    assert all(r["session"] == "swiglu/s0" for r in data["rows"])
    replayed = (out / "ops" / "swiglu" / "transcript.jsonl").read_text()
    assert replayed.count('"kind": "response"') == 4  # every recorded reply, served again
    assert ctx.registry.variants("swiglu") == ["claude_tiles_v1"]  # the run's, not the replay's
