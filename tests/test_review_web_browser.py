"""The review page in a real browser: Debian's chromium driven by Playwright, against
`autoopt review serve` on loopback (uvicorn in a thread) over a copy of the committed kernels/
plus one judged candidate (tests/review_web_support.py). CI installs chromium with apt
(.ci/run); no browser is downloaded."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pytest

from autoopt import env
from autoopt.review_web import Runs, prepare
from autoopt.review_web.server import in_thread
from model.registry import writers

from .review_web_support import (
    CHROMIUM,
    CHROMIUM_ARGS,
    FIXED,
    NAME,
    OP,
    RUN,
    SELECTED_SM90,
    build,
    cli,
    files,
    judged,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path(CHROMIUM).is_file(),
                       reason=f"no {CHROMIUM}: install it with `apt-get install -y chromium` "
                              "(.ci/run does)"),
    pytest.mark.skipif(importlib.util.find_spec("playwright") is None,
                       reason="playwright is not installed (pip install -e '.[test]')"),
]


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    # Chromium's singleton socket lies ~45 characters below TMPDIR; a long TMPDIR would pass
    # the socket path limit and Chromium would abort at launch.
    short = env.socket_safe_tmpdir(48)
    launch_env = {**os.environ, "TMPDIR": short} if short else None
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, env=launch_env)
        yield b
        b.close()
    if short:
        shutil.rmtree(short, ignore_errors=True)


@pytest.fixture
def twin(tmp_path, monkeypatch):
    """The demo registry served to the browser, and an identical one for the CLI."""
    monkeypatch.setattr(writers, "now_iso", lambda: FIXED)
    report, rows = judged()
    reg, runs = build(tmp_path / "web", report, rows)
    return reg, runs, build(tmp_path / "cli", report, rows)[0]


@pytest.fixture
def served(twin):
    reg, runs, _ = twin
    s = prepare(reg, Runs(runs), "127.0.0.1", 0)
    with in_thread(s):
        yield s


@pytest.fixture
def page(browser, served):
    context = browser.new_context(viewport={"width": 1300, "height": 900})
    pg = context.new_page()
    assert pg.goto(served.url).status == 200  # the token URL, redirected to the overview
    assert pg.url == served.base + "/"
    yield pg
    context.close()


def test_candidate_page_renders_its_diff_and_plots(page, served):
    page.click(f"a[href='/variant/{OP}/{NAME}']")
    assert page.locator("h1").inner_text().startswith(f"{OP} / {NAME}")
    page.click("text=sm_90")  # what it would replace on the H200: the locked variant
    page.wait_for_load_state("networkidle")
    assert f"{OP}/{SELECTED_SM90} (selected for sm_90)" in page.locator("#diff-table").inner_text()
    assert page.locator("#diff-table tr.insert, #diff-table tr.replace").count() > 10
    assert page.locator("#diff-table span.k").count() > 0  # highlighted keywords
    plots = page.locator("img.plot")
    assert plots.count() >= 1
    for i in range(plots.count()):  # each SVG was fetched and decoded by the browser
        assert plots.nth(i).evaluate("img => img.complete && img.naturalWidth") > 100
    assert page.locator(".verification").count() >= 1
    assert "bf16_two_step" in page.locator("#evidence ~ .panel").first.inner_text()
    page.click(f"a[href='/runs/{RUN}']")
    assert page.locator(f"a[href='/variant/{OP}/{NAME}']").count() >= 1


def test_accept_in_the_browser_writes_what_the_cli_writes(page, twin):
    reg, _, cli_reg = twin
    page.goto(page.url + f"variant/{OP}/{NAME}")
    page.select_option("#accept-form select[name=arch]", "cpu")
    page.click("#accept-form button")
    assert f"accepted {OP}/{NAME}" in page.locator("[data-flash=ok]").inner_text()
    assert "accepted" in page.locator("h1 .badge").inner_text()
    assert cli("review", "accept", OP, NAME, "--arch", "cpu", "--registry",
               str(cli_reg.root)).exit_code == 0
    assert files(reg.root) == files(cli_reg.root)


def test_reject_in_the_browser_writes_what_the_cli_writes(page, twin):
    reg, _, cli_reg = twin
    why = "two rows per program spill registers at I=2560"
    page.goto(page.url + f"variant/{OP}/{NAME}")
    page.fill("#reject-form textarea", why)
    page.click("#reject-form button")
    assert page.locator("#status-reason").inner_text() == why
    assert cli("review", "reject", OP, NAME, "--why", why, "--registry",
               str(cli_reg.root)).exit_code == 0
    assert files(reg.root) == files(cli_reg.root)


def test_without_the_token_the_browser_is_refused(browser, served):
    context = browser.new_context()
    pg = context.new_page()
    response = pg.goto(served.base + f"/variant/{OP}/{NAME}")
    assert response.status == 403 and "token" in pg.inner_text("body")
    context.close()


@pytest.mark.parametrize("origin, why", [
    ("http://evil.test", "no token"),  # another site: the SameSite=Strict cookies stay home
    ("http://127.0.0.1:9", "cross-origin write refused"),  # same site, another origin
])
def test_a_cross_site_post_without_the_csrf_token_is_refused(page, served, twin, origin, why):
    """A page elsewhere posts an accept form (no CSRF token); the registry is not touched."""
    reg = twin[0]
    before = files(reg.root)
    form = (f'<form method="post" action="{served.base}/variant/{OP}/{NAME}/accept">'
            '<input type="hidden" name="arch" value="cpu"><button id="go">go</button></form>')
    page.route(f"{origin}/**", lambda route: route.fulfill(
        status=200, content_type="text/html", body=f"<!doctype html><html><body>{form}"))
    page.goto(f"{origin}/attack")
    with page.expect_navigation() as nav:
        page.click("#go")
    assert nav.value.status == 403
    assert why in page.inner_text("body")
    assert files(reg.root) == before


def test_a_broken_record_shows_an_error_not_a_crash(page, twin):
    reg = twin[0]
    reg.record_path("rmsnorm", "triton_v2").write_text('{"schema": 2, "variant": ')
    home = page.goto(page.url)
    assert home.status == 200
    row = page.locator("tr[data-variant=triton_v2][data-status=broken]")
    assert row.count() == 1 and "not valid JSON" in row.inner_text()
    response = page.goto(page.url + "variant/rmsnorm/triton_v2")
    assert response.status == 422
    assert "not valid JSON" in page.locator("#error").inner_text()
    assert "Traceback" not in page.content()
