"""`autoopt review serve` over HTTP: the token, Host, Origin and CSRF checks, error pages, and
the page agreeing with (and writing exactly what) the CLI does. A real server on loopback
(uvicorn in a thread), a copy of the committed kernels/ plus one judged candidate.
The browser-driven tests are tests/test_review_web_browser.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from autoopt.registry_cmd import listing
from autoopt.review_web import Runs, prepare, security
from autoopt.review_web.server import banner, in_thread
from autoopt.review_web.sources import side_by_side
from model.registry import shipped_root, writers

from .review_web_support import FIXED, NAME, OP, RUN, SELECTED_SM90, build, cli, files, judged

pytestmark = pytest.mark.slow  # the judge and the timer run once (~15 s), then each server ~1 s


@pytest.fixture
def demo(tmp_path):
    report, rows = judged()
    return build(tmp_path / "a", report, rows)


@pytest.fixture
def server(demo):
    reg, runs = demo
    served = prepare(reg, Runs(runs), "127.0.0.1", 0)
    with in_thread(served):
        yield served


def client(served, login: bool = True) -> httpx.Client:
    c = httpx.Client(base_url=served.base, timeout=30)
    if login:
        r = c.get(f"/?token={served.token}")
        assert r.status_code == 303 and r.headers["location"] == "/"
        assert {security.TOKEN_COOKIE, security.SESSION_COOKIE} <= set(c.cookies)
    return c


def csrf_of(html: str) -> str:
    return re.search(r'name="csrf" value="([0-9a-f]+)"', html).group(1)


def post(c: httpx.Client, served, path: str, data: dict, origin: str | None = "self"):
    headers = {"Origin": served.base if origin == "self" else origin} if origin else {}
    return c.post(path, data=data, headers=headers)


# ---- the token, Host, Origin, CSRF -------------------------------------------------------------
def test_without_the_token_every_page_is_refused(server):
    c = client(server, login=False)
    for path in ("/", f"/variant/{OP}/{NAME}", "/runs", "/static/style.css", "/nowhere"):
        r = c.get(path)
        assert r.status_code == 403 and "token" in r.text, path
    assert c.get("/?token=wrong-token-of-some-length").status_code == 403
    forged = httpx.Client(base_url=server.base, cookies={security.TOKEN_COOKIE: "x" * 40})
    assert forged.get("/").status_code == 403


def test_token_sets_strict_httponly_cookies_and_leaves_the_url(server):
    c = httpx.Client(base_url=server.base)
    r = c.get(f"/runs?token={server.token}")
    assert r.status_code == 303 and r.headers["location"] == "/runs"
    cookies = r.headers.get_list("set-cookie")
    assert len(cookies) == 2
    assert all("HttpOnly" in h and "SameSite=strict" in h for h in cookies), cookies
    page = c.get("/runs")
    assert page.status_code == 200
    assert "script-src" not in page.headers["content-security-policy"]  # none allowed at all
    assert "default-src 'none'" in page.headers["content-security-policy"]


def test_a_foreign_host_header_is_refused(server):
    c = client(server)
    r = c.get("/", headers={"Host": "attacker.example:80"})
    assert r.status_code == 403 and "Host" in r.text


def test_writes_need_same_origin_and_the_session_csrf_token(server, demo):
    reg, _ = demo
    before = files(reg.root)
    c = client(server)
    token = csrf_of(c.get(f"/variant/{OP}/{NAME}").text)
    path = f"/variant/{OP}/{NAME}/reject"
    cases = [({"why": "x"}, "self"),                          # no CSRF token
             ({"why": "x", "csrf": "0" * 64}, "self"),        # a wrong one
             ({"why": "x", "csrf": token}, "http://evil.example"),  # cross-site, even with it
             ({"why": "x", "csrf": token}, "null"),
             ({"why": "x", "csrf": token}, None)]             # no Origin nor Referer
    for data, origin in cases:
        r = post(c, server, path, data, origin)
        assert r.status_code == 403, (data, origin, r.text[:300])
    other = client(server)  # another session: its own CSRF token
    r = post(other, server, path, {"why": "x", "csrf": token})
    assert r.status_code == 403
    assert c.get(path).status_code == 405  # writes are POST only
    assert files(reg.root) == before


# ---- the page and the CLI agree --------------------------------------------------------------
def test_overview_shows_every_variant_as_registry_list_does(server, demo):
    reg, _ = demo
    html = client(server).get("/").text
    rows = re.findall(r'<tr data-variant="(\w+)" data-status="(\w+)" data-verified="([^"]*)"',
                      html)
    ops = re.findall(r'<table class="variants" data-op="(\w+)">', html)
    assert len(ops) == len(reg.ops())
    listed = [(r["variant"], r["status"], r["verified"]) for r in listing(reg)]
    assert sorted(rows) == sorted(listed)
    assert (NAME, "candidate", "cpu:pass") in rows
    # The committed kernels as `review list --status accepted` shows them.
    accepted = json.loads(cli("review", "list", "--status", "accepted", "--registry",
                              str(shipped_root()), "--json").stdout)
    for r in accepted:
        assert (r["variant"], "accepted", r["verified"]) in rows
    pending = re.search(r"(\d+) candidates? awaiting review</strong>:(.*?)</p>", html, re.S)
    links = re.findall(r'<a href="/variant/(\w+)/(\w+)"', pending.group(2))
    assert ("swiglu", "claude_rows_v1") in links
    candidates = [(r["op"], r["variant"]) for r in listing(reg) if r["status"] == "candidate"]
    assert int(pending.group(1)) == len(links) and sorted(links) == sorted(candidates)


def test_candidate_page_shows_diff_evidence_plots_notes_and_transcript(server):
    c = client(server)
    # By default against what it would replace where it passed (cpu: nothing locked there).
    assert "Diff against reference" in c.get(f"/variant/{OP}/{NAME}").text
    html = c.get(f"/variant/{OP}/{NAME}?arch=sm_90").text
    assert f"{OP}/{SELECTED_SM90} (selected for sm_90)" in html
    assert html.count('<tr class="insert">') + html.count('<tr class="replace">') > 10
    assert '<span class="k">def</span>' in html  # highlighted by pygments
    cpu = c.get(f"/variant/{OP}/{NAME}?arch=cpu").text
    assert "swiglu/reference (selected for cpu)" in cpu  # nothing locked for cpu
    # The judge adds drawn, long and edge-case shapes to the two given: a count, not 2.
    assert re.search(r"Per shape and seed \(\d+", cpu)
    for text in ("ulp histogram", "Near misses", "bf16_two_step",
                 "static_screen", "Time per token bucket", "CPU: not meaningful for speed",
                 "two rows per program halve the launches", "I will tile two rows",
                 "harness", f'href="/runs/{RUN}"'):
        assert text in cpu, text
    svg = c.get(f"/variant/{OP}/{NAME}/time-0.svg")
    assert svg.status_code == 200 and svg.headers["content-type"] == "image/svg+xml"
    assert b"<svg" in svg.content and b"candidate (claude_rows_v1)" in svg.content
    assert c.get(f"/variant/{OP}/{NAME}/time-9.svg").status_code == 404


def test_run_page_links_attempts_to_candidates_and_renders_the_report_safely(server, demo):
    _, runs = demo
    other = {"attempt": {"index": 2, "op": OP, "candidate": "a02_x", "sha256": "0" * 64,
                         "verdict": "pass", "outcome": f"registered {OP}/triton_v2 as candidate"}}
    with (runs / RUN / "attempts.jsonl").open("a") as f:
        f.write(json.dumps(other) + "\n{ half a line")
    c = client(server)
    html = c.get(f"/runs/{RUN}").text
    assert f'href="/variant/{OP}/{NAME}"' in html
    # Another registry's variant of the same name is not this one: no link to it.
    assert f"registered {OP}/triton_v2 as candidate" in html
    assert f'href="/variant/{OP}/triton_v2"' not in html
    assert f'src="/runs/{RUN}/files/plots/time_per_op.png"' in html
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert c.get(f"/runs/{RUN}/files/plots/time_per_op.png").headers["content-type"] == \
        "image/png"
    for bad in ("state.json", "../registry/registry.lock.toml", "..%2Fstate.json"):
        assert c.get(f"/runs/{RUN}/files/{bad}").status_code in (403, 404), bad
    assert c.get("/runs/%2E%2E").status_code == 404
    cand = c.get(f"/runs/{RUN}/candidates/{OP}/a01_rows").text
    assert "_swiglu_rows_kernel" in cand
    index = c.get("/runs").text
    assert RUN in index and f'href="/variant/{OP}/{NAME}"' in index


def test_broken_record_is_an_error_page_not_a_crash(server, demo):
    reg, _ = demo
    reg.record_path("rmsnorm", "triton_v2").write_text("{ not json")
    c = client(server)
    page = c.get("/variant/rmsnorm/triton_v2")
    assert page.status_code == 422 and "not valid JSON" in page.text
    assert "Traceback" not in page.text
    home = c.get("/")
    assert home.status_code == 200 and 'data-status="broken"' in home.text
    assert c.get("/variant/rmsnorm/nope").status_code == 404
    assert c.get("/variant/no-such-op!/x").status_code in (404, 422)


def test_an_internal_error_is_a_500_page_without_the_traceback(server, monkeypatch):
    from autoopt.review_web import pages

    def boom(*a, **k):
        raise RuntimeError("secret internals")

    monkeypatch.setattr(pages, "runs_index", boom)
    r = client(server).get("/runs")
    assert r.status_code == 500 and "error id" in r.text
    assert "secret internals" not in r.text and "Traceback" not in r.text


# ---- writes: byte-identical to the CLI's -------------------------------------------------------
@pytest.fixture
def twin(tmp_path, monkeypatch):
    """A second, identical registry for the CLI; timestamps fixed for both."""
    monkeypatch.setattr(writers, "now_iso", lambda: FIXED)
    report, rows = judged()
    return build(tmp_path / "b", report, rows)[0]


def _web_write(server, action: str, data: dict):
    c = client(server)
    token = csrf_of(c.get(f"/variant/{OP}/{NAME}").text)
    r = post(c, server, f"/variant/{OP}/{NAME}/{action}", {**data, "csrf": token})
    assert r.status_code == 303, r.text[:500]
    return c.get(r.headers["location"]).text


def test_accept_writes_what_the_cli_writes(server, demo, twin):
    reg, _ = demo
    assert files(reg.root) == files(twin.root)
    page = _web_write(server, "accept", {"arch": "cpu"})
    assert f"accepted {OP}/{NAME} and selected it for cpu" in page
    assert cli("review", "accept", OP, NAME, "--arch", "cpu", "--registry",
               str(twin.root)).exit_code == 0
    assert files(reg.root) == files(twin.root)
    assert reg.read_record(OP, NAME).status == "accepted"
    assert reg.config_path(OP, NAME).is_file()  # its proposed configs moved in


def test_reject_writes_what_the_cli_writes(server, demo, twin):
    reg, _ = demo
    why = "rows of two: no gain at decode <b>&</b> more registers"
    page = _web_write(server, "reject", {"why": why})
    assert "rows of two: no gain at decode &lt;b&gt;&amp;&lt;/b&gt;" in page
    assert cli("review", "reject", OP, NAME, "--why", why, "--registry",
               str(twin.root)).exit_code == 0
    assert files(reg.root) == files(twin.root)
    assert reg.read_record(OP, NAME).status_reason == why


def test_lock_writes_what_the_cli_writes_and_refusals_are_shown(server, demo, twin):
    reg, _ = demo
    for r in (reg, twin):
        writers.set_status(r, OP, NAME, "accepted", "reviewed")
    page = _web_write(server, "lock", {"arch": "sm_90"})  # never verified there: refused
    assert "no passing verification on sm_90" in page
    _web_write(server, "lock", {"arch": "cpu"})
    assert cli("registry", "lock", "--arch", "cpu", "--op", OP, "--variant", NAME,
               "--registry", str(twin.root)).exit_code == 0
    assert files(reg.root) == files(twin.root)
    assert reg.read_lock().section("cpu")[OP].variant == NAME


def test_reject_needs_a_reason(server, demo):
    reg, _ = demo
    page = _web_write(server, "reject", {"why": "  "})
    assert "reject needs a reason" in page
    assert reg.read_record(OP, NAME).status == "candidate"


# ---- start-up -----------------------------------------------------------------------------------
def test_loopback_by_default_and_a_loud_warning_otherwise(demo):
    reg, runs = demo
    assert security.allowed_hosts("0.0.0.0", 80) is None
    assert "127.0.0.1:80" in security.allowed_hosts("127.0.0.1", 80)
    for host, warned in (("127.0.0.1", False), ("0.0.0.0", True)):
        served = prepare(reg, Runs(runs), host, 0)
        warnings, lines = banner(served, reg, runs, host)
        served.sock.close()
        assert bool(warnings) == warned and any("?token=" in line for line in lines)
        assert not warned or "WARNING" in warnings[0]


def test_the_cli_command_serves_and_prints_the_url(demo):
    reg, runs = demo
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.Popen([sys.executable, "-m", "autoopt.cli", "review", "serve",
                             "--registry", str(reg.root), "--runs-dir", str(runs), "--port",
                             "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    try:
        url, deadline = None, time.monotonic() + 60
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            m = re.search(r"(http://127\.0\.0\.1:\d+)/\?token=(\S+)", line)
            url = m.groups() if m else None
        assert url, "no URL printed"
        base, token = url
        for _ in range(100):
            try:
                with httpx.Client(base_url=base) as c:
                    assert c.get("/").status_code == 403
                    assert c.get(f"/?token={token}", follow_redirects=True).status_code == 200
                break
            except httpx.ConnectError:
                time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(10)


def test_side_by_side_diff_pairs_lines_and_folds_context():
    old = "".join(f"x{i} = {i}\n" for i in range(40))
    new = old.replace("x5 = 5\n", "x5 = 50\n").replace("x30 = 30\n", "")
    d = side_by_side(old, new, "a", "b", context=2)
    kinds = [r.kind for r in d.rows]
    assert d.added == 1 and d.removed == 2
    assert kinds.count("replace") == 1 and kinds.count("delete") == 1
    assert kinds[0] == "fold" and kinds[-1] == "fold"
    assert sum(r.folded for r in d.rows) + sum(r.left_no is not None for r in d.rows) == 40
    assert side_by_side(old, old, "a", "b").identical
