"""Agents that propose kernel variants, by name: `make_agent("template")`, `make_agent("claude")`.

A small protocol (`base.Agent`) plus a name registry, so the loop never branches on the agent's
kind. Each agent declares its options as a frozen dataclass (`AgentSpec.options`): the CLI's
`--agent-option KEY=VALUE` and its shorthands are parsed against it (`parse_options`), so the
loop passes a plain dict it never reads. An agent may also declare how to replay its recorded
sessions without its service (`AgentSpec.replay`). Factories import lazily: the template agent
never needs `anthropic`, and the Claude agent never needs Optuna.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .base import (
    Agent,
    Attempt,
    Evaluator,
    Feedback,
    Limits,
    OptimizationTask,
    Proposal,
    Session,
    SessionContext,
    SessionResult,
    run_session,
)


@dataclass(frozen=True)
class AgentSpec:
    """An agent as the registry knows it: how to build it, its options, and its replayer."""

    name: str
    summary: str
    factory: Callable[..., Agent]
    options: Callable[[], type]  # the options dataclass (imported on demand)
    replay: Callable[..., Any] | None = None  # (run_dir, evaluator_for, ...) -> rows

    def option_fields(self) -> dict[str, dataclasses.Field]:
        return {f.name: f for f in dataclasses.fields(self.options())}


def _template(**options: Any) -> Agent:
    from .template import TemplateAgent

    return TemplateAgent(**options)


def _template_options() -> type:
    from .template import TemplateOptions

    return TemplateOptions


def _claude(**options: Any) -> Agent:
    from .claude import ClaudeAgent

    return ClaudeAgent(**options)


def _claude_options() -> type:
    from .claude import ClaudeOptions

    return ClaudeOptions


def _claude_replay(*args: Any, **kw: Any) -> Any:
    from .transcript import replay_sessions

    return replay_sessions(*args, **kw)


AGENTS: dict[str, AgentSpec] = {
    "template": AgentSpec("template", "offline: the built-in Triton templates, tuned with "
                          "Optuna per token bucket", _template, _template_options),
    "claude": AgentSpec("claude", "Claude through the Anthropic API, with tools to read, check, "
                        "profile and submit", _claude, _claude_options, _claude_replay),
}


def spec(name: str) -> AgentSpec:
    try:
        return AGENTS[name]
    except KeyError:
        raise ValueError(f"unknown agent {name!r}; known agents: {', '.join(AGENTS)}") from None


def make_agent(name: str, **options: Any) -> Agent:
    """The agent registered as `name`, built with `options` (unknown names list the known)."""
    return spec(name).factory(**options)


def _convert(name: str, field: dataclasses.Field, value: Any) -> Any:
    if not isinstance(value, str):
        return value
    kind = _resolve(field.type) if isinstance(field.type, str) else field.type
    for t in [t for t in (typing.get_args(kind) or (kind,)) if t is not type(None)]:
        try:
            return (value.lower() in ("1", "true", "yes", "on")) if t is bool else t(value)
        except (TypeError, ValueError):
            continue
    raise ValueError(f"agent option {name}={value!r}: expected {field.type}")


def _resolve(text: str) -> Any:
    return {"int": int, "float": float, "str": str, "bool": bool, "int | None": int | None,
            "float | None": float | None, "str | None": str | None}.get(text, str)


def parse_options(name: str, raw: Mapping[str, Any]) -> dict[str, Any]:
    """`raw` ({key: value or text}) checked against agent `name`'s declared options."""
    fields = spec(name).option_fields()
    out = {}
    for key, value in raw.items():
        if value is None:
            continue
        if key not in fields:
            raise ValueError(f"the {name} agent has no option {key!r}; its options: "
                             f"{', '.join(describe_options(name))}")
        out[key] = _convert(key, fields[key], value)
    spec(name).options()(**out)  # validates (each options class checks itself)
    return out


def describe_options(name: str) -> list[str]:
    out = []
    for f in spec(name).option_fields().values():
        default = f.default if f.default is not dataclasses.MISSING else "-"
        out.append(f"{f.name}={default}")
    return out


def default_agent() -> str:
    """`claude` when an Anthropic key is configured, else the offline `template` agent."""
    from autoopt import env

    return "claude" if env.anthropic_api_key() else "template"


__all__ = ["AGENTS", "Agent", "AgentSpec", "Attempt", "Evaluator", "Feedback", "Limits",
           "OptimizationTask", "Proposal", "Session", "SessionContext", "SessionResult",
           "default_agent", "describe_options", "make_agent", "parse_options", "run_session",
           "spec"]
