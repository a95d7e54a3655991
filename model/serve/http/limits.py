"""Limits on what an HTTP client may send and how slowly (`autoopt serve` flags).

A module of its own, without web imports, so the CLI can show the defaults without loading them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HTTPLimits:
    """Limits on what a client may send and how slowly (`autoopt serve` flags)."""

    max_request_bytes: int = 16 * 2**20
    body_timeout_s: float = 30.0  # the whole body, from the end of the headers
    header_timeout_s: float = 10.0  # a request's head, from the connection or the last answer

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "body_timeout_s", "header_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
