"""Agents that propose kernel variants, by name: `make_agent("template")`, `make_agent("claude")`.

A small protocol (`base.Agent`) plus a name registry, so the loop never branches on the agent's
kind. Factories import lazily: the template agent never needs `anthropic`, and the Claude agent
never needs Optuna.
"""

from __future__ import annotations

from collections.abc import Callable
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
    SessionResult,
    run_session,
)


def _template(**options: Any) -> Agent:
    from .template import TemplateAgent

    return TemplateAgent(**options)


def _claude(**options: Any) -> Agent:
    from .claude import ClaudeAgent

    return ClaudeAgent(**options)


AGENTS: dict[str, Callable[..., Agent]] = {"template": _template, "claude": _claude}


def make_agent(name: str, **options: Any) -> Agent:
    """The agent registered as `name`, built with `options` (unknown names list the known)."""
    try:
        factory = AGENTS[name]
    except KeyError:
        raise ValueError(f"unknown agent {name!r}; known agents: {', '.join(AGENTS)}") from None
    return factory(**options)


def default_agent() -> str:
    """`claude` when an Anthropic key is configured, else the offline `template` agent."""
    from autoopt import env

    return "claude" if env.anthropic_api_key() else "template"


__all__ = ["AGENTS", "Agent", "Attempt", "Evaluator", "Feedback", "Limits", "OptimizationTask",
           "Proposal", "Session", "SessionResult", "default_agent", "make_agent", "run_session"]
