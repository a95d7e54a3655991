"""Who may read and write through the review page: a start-up token, a session, CSRF, Host.

The server prints `http://HOST:PORT/?token=...` at start-up (as Jupyter does). Opening it sets
two cookies, both HttpOnly and SameSite=Strict: the token itself (every later request must carry
it) and a random session id. The page then redirects to the same URL without the token, so it
stays out of the history. Every request is refused (403) without the token, or with a Host
header that is not this server's (DNS rebinding). Writes are POST only and need, in addition, a
same-origin Origin (or Referer) header and the session's CSRF token in the form; the CSRF token
is an HMAC of the session id under a key drawn at start-up, so nothing is stored per session.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

TOKEN_COOKIE = "autoopt_review_token"
SESSION_COOKIE = "autoopt_review_session"
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
# Every page is server-rendered: no script runs, whatever a record or a report contains.
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'self'; img-src 'self'; "
                               "form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def is_loopback(host: str) -> bool:
    """`host` (a name or an address) is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def allowed_hosts(host: str, port: int) -> frozenset[str] | None:
    """Host headers this server answers to; None (any) when bound to a non-loopback address,
    whose names this server cannot know (the start-up warning says so)."""
    if not is_loopback(host):
        return None
    names = {*LOOPBACK_NAMES, host if ":" not in host else f"[{host}]"}
    return frozenset(f"{n}:{port}" for n in names)


@dataclass(frozen=True)
class Guard:
    """The checks every request goes through; `token` is the one printed at start-up."""

    token: str
    hosts: frozenset[str] | None
    key: bytes = field(default_factory=lambda: secrets.token_bytes(32), repr=False)

    def __post_init__(self) -> None:
        if len(self.token) < 16:
            raise ValueError("the review token must be at least 16 characters")

    @staticmethod
    def new_token() -> str:
        return secrets.token_urlsafe(32)

    @staticmethod
    def new_session() -> str:
        return secrets.token_urlsafe(24)

    def token_ok(self, given: str | None) -> bool:
        return given is not None and hmac.compare_digest(given.encode(), self.token.encode())

    def host_problem(self, host: str | None) -> str | None:
        if self.hosts is None:
            return None
        if host not in self.hosts:
            return f"this server answers to {', '.join(sorted(self.hosts))}, not Host {host!r}"
        return None

    def csrf(self, session: str) -> str:
        return hmac.new(self.key, f"csrf:{session}".encode(), hashlib.sha256).hexdigest()

    def csrf_ok(self, session: str | None, given: str | None) -> bool:
        if not session or not given:
            return False
        return hmac.compare_digest(self.csrf(session).encode(), given.encode())

    def origin_problem(self, headers: Mapping[str, str], host: str | None) -> str | None:
        """A write must come from a page of this server: its Origin (else Referer) is ours."""
        origin = headers.get("origin")
        source = origin if origin is not None else headers.get("referer")
        if source is None:
            return "a write needs an Origin or Referer header (send it from the review page)"
        parts = urlsplit(source)
        if source == "null" or parts.scheme not in ("http", "https") or parts.netloc != host:
            return f"cross-origin write refused (from {source!r}, this server is {host!r})"
        return None

    def cookie_args(self) -> dict:
        return {"httponly": True, "samesite": "strict", "path": "/"}
