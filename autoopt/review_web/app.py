"""The review app: server-rendered pages over a registry and a runs directory, and the three
writes a reviewer makes (accept, reject, lock), each through the function the CLI calls.

    GET  /                                       the registry by op, the lock
    GET  /variant/{op}/{name}[?arch=]            diff, evidence, timings, notes, transcript
    GET  /variant/{op}/{name}/time-{i}.svg       time per token bucket (timing group i)
    POST /variant/{op}/{name}/accept|reject|lock autoopt.review.accept / reject, writers.lock
    GET  /runs, /runs/{run}                      optimize runs: report, attempts, plots
    GET  /runs/{run}/files/{path}                a run's plot (PNG/SVG)
    GET  /runs/{run}/candidates/{op}/{stem}      a run's candidate file and its attempt

Every request passes `security.Guard` (token, Host; Origin and CSRF for writes). Errors are
pages: a missing thing 404, a registry that refuses or cannot read 422, anything else 500 with
an id to find the traceback in the server's log (never in the page).
"""

from __future__ import annotations

import logging
import secrets
import threading
from pathlib import Path
from urllib.parse import parse_qs, urlencode

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from jinja2 import Environment, PackageLoader, select_autoescape
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from model.registry import Registry, RegistryError, writers

from .. import review
from . import pages, security
from .evidence import fmt
from .plots import time_per_bucket_svg
from .runs import IMAGE_TYPES, RunNotFound, Runs
from .sources import pygments_css

log = logging.getLogger("autoopt.review_web")
STATIC = Path(__file__).resolve().parent / "static"
MAX_FORM_BYTES = 64 << 10


class Refused(Exception):
    """A write refused before it reached the registry (CSRF, form)."""


def _templates() -> Environment:
    env = Environment(loader=PackageLoader("autoopt.review_web", "templates"),
                      autoescape=select_autoescape(default=True),
                      trim_blocks=True, lstrip_blocks=True)
    env.globals.update(fmt=fmt, pct=lambda x: "-" if x is None else f"{100 * x:.1f}%")
    return env


class ReviewApp:
    """Holds the registry, the runs, the guard, the flash messages and the write lock."""

    def __init__(self, reg: Registry, runs: Runs, guard: security.Guard) -> None:
        self.reg, self.runs, self.guard = reg, runs, guard
        self.env = _templates()
        self.write_lock = threading.Lock()  # one registry write at a time
        self._flash: dict[str, list[tuple[str, str]]] = {}
        self._flash_lock = threading.Lock()

    def flash(self, session: str, kind: str, text: str) -> None:
        with self._flash_lock:
            self._flash.setdefault(session, []).append((kind, text))

    def take_flash(self, session: str) -> list[tuple[str, str]]:
        with self._flash_lock:
            return self._flash.pop(session, [])

    def page(self, request: Request, template: str, status: int = 200, **ctx) -> HTMLResponse:
        session = getattr(request.state, "session", "")
        html = self.env.get_template(template).render(
            csrf=self.guard.csrf(session) if session else "", flash=self.take_flash(session),
            **ctx)
        return HTMLResponse(html, status_code=status)

    def error(self, request: Request, status: int, title: str, message: str) -> HTMLResponse:
        return self.page(request, "error.html", status=status, title=title, message=message)


async def _form(request: Request, review_app: ReviewApp) -> dict[str, str]:
    ctype = request.headers.get("content-type", "").split(";")[0].strip()
    if ctype != "application/x-www-form-urlencoded":
        raise Refused(f"a write is a form post (application/x-www-form-urlencoded), not {ctype!r}")
    body = await request.body()
    if len(body) > MAX_FORM_BYTES:
        raise Refused("form too large")
    form = {k: v[0] for k, v in parse_qs(body.decode(errors="replace"),
                                         keep_blank_values=True).items()}
    if not review_app.guard.csrf_ok(request.state.session, form.get("csrf")):
        raise Refused("missing or wrong CSRF token: reload the page and try again")
    return form


def create_app(reg: Registry, runs: Runs, guard: security.Guard) -> FastAPI:
    app = FastAPI(title="autoopt review", docs_url=None, redoc_url=None, openapi_url=None)
    ra = ReviewApp(reg, runs, guard)
    app.state.review = ra
    _guard_middleware(app, ra)
    _error_handlers(app, ra)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    _read_routes(app, ra)
    _write_routes(app, ra)
    return app


def _refuse(ra: ReviewApp, reason: str) -> Response:
    html = ra.env.get_template("refused.html").render(reason=reason)
    return HTMLResponse(html, status_code=403, headers=security.HEADERS)


def _guard_middleware(app: FastAPI, ra: ReviewApp) -> None:
    guard = ra.guard

    @app.middleware("http")
    async def check(request: Request, call_next):
        host = request.headers.get("host")
        problem = guard.host_problem(host)
        if problem:
            return _refuse(ra, problem)
        given = request.query_params.get("token")
        session = request.cookies.get(security.SESSION_COOKIE) or ""
        if given is not None:
            if not guard.token_ok(given) or request.method != "GET":
                return _refuse(ra, "wrong token: open the URL the server printed at start-up")
            rest = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
            target = request.url.path + (f"?{urlencode(rest)}" if rest else "")
            resp = RedirectResponse(target, status_code=303, headers=security.HEADERS)
            resp.set_cookie(security.TOKEN_COOKIE, guard.token, **guard.cookie_args())
            if not _valid_session(session):
                resp.set_cookie(security.SESSION_COOKIE, guard.new_session(),
                                **guard.cookie_args())
            return resp
        if not guard.token_ok(request.cookies.get(security.TOKEN_COOKIE)):
            return _refuse(ra, "no token: open the URL with ?token=... that `autoopt review "
                               "serve` printed at start-up")
        fresh = None if _valid_session(session) else guard.new_session()
        request.state.session = fresh or session
        if request.method not in ("GET", "HEAD"):
            problem = guard.origin_problem(request.headers, host)
            if problem:
                return _refuse(ra, problem)
        response = await call_next(request)
        if fresh:
            response.set_cookie(security.SESSION_COOKIE, fresh, **guard.cookie_args())
        for k, v in security.HEADERS.items():
            response.headers.setdefault(k, v)
        return response


def _valid_session(session: str) -> bool:
    return 16 <= len(session) <= 64 and all(c.isalnum() or c in "-_" for c in session)


def _error_handlers(app: FastAPI, ra: ReviewApp) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return ra.error(request, 404, "Not found", f"nothing at {request.url.path}")
        return ra.error(request, exc.status_code, "Refused", str(exc.detail))

    @app.exception_handler(pages.NotFound)
    @app.exception_handler(RunNotFound)
    async def not_found(request: Request, exc: Exception):
        return ra.error(request, 404, "Not found", str(exc))

    @app.exception_handler(RegistryError)
    async def registry_error(request: Request, exc: RegistryError):
        return ra.error(request, 422, "The registry cannot show this", str(exc))

    @app.exception_handler(Refused)
    async def refused(request: Request, exc: Refused):
        return ra.error(request, 403, "Refused", str(exc))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):
        ref = secrets.token_hex(4)
        log.error("review page %s failed (error id %s)", request.url.path, ref, exc_info=exc)
        return ra.error(request, 500, "Internal error", f"the page could not be made (error id "
                        f"{ref}); the server's log has the details")


def _read_routes(app: FastAPI, ra: ReviewApp) -> None:
    @app.get("/", response_class=HTMLResponse)
    def index(request: Request):
        return ra.page(request, "overview.html", **pages.overview(ra.reg, ra.runs))

    @app.get("/variant/{op}/{name}", response_class=HTMLResponse)
    def variant(request: Request, op: str, name: str, arch: str | None = None):
        return ra.page(request, "variant.html", **pages.variant(ra.reg, ra.runs, op, name, arch))

    @app.get("/variant/{op}/{name}/time-{index}.svg")
    def plot(op: str, name: str, index: int, arch: str | None = None):
        groups, current = pages.timings(ra.reg, op, name, arch)
        if not 0 <= index < len(groups):
            raise pages.NotFound(f"{op}/{name} has no timing group {index}")
        svg = time_per_bucket_svg(groups[index], name, current)
        return Response(svg, media_type="image/svg+xml")

    @app.get("/static-pygments.css")
    def pygments():
        return Response(pygments_css(), media_type="text/css")

    @app.get("/runs", response_class=HTMLResponse)
    def runs_index(request: Request):
        return ra.page(request, "runs.html", **pages.runs_index(ra.reg, ra.runs))

    @app.get("/runs/{run}", response_class=HTMLResponse)
    def run(request: Request, run: str):
        return ra.page(request, "run.html", **pages.run(ra.reg, ra.runs, run))

    @app.get("/runs/{run}/files/{rel:path}")
    def run_file(run: str, rel: str):
        path = ra.runs.file(run, rel)
        if path.suffix not in IMAGE_TYPES:
            raise pages.NotFound(f"{rel}: only a run's plots (PNG, SVG) are served")
        return FileResponse(path, media_type=IMAGE_TYPES[path.suffix])

    @app.get("/runs/{run}/candidates/{op}/{candidate}", response_class=HTMLResponse)
    def candidate(request: Request, run: str, op: str, candidate: str):
        return ra.page(request, "candidate.html",
                       **pages.candidate_file(ra.runs, run, op, candidate))


def _write_routes(app: FastAPI, ra: ReviewApp) -> None:
    async def write(request: Request, op: str, name: str, action) -> Response:
        form = await _form(request, ra)
        back = f"/variant/{op}/{name}"

        def locked() -> str:
            with ra.write_lock:
                return action(form)
        try:
            message = await run_in_threadpool(locked)
            ra.flash(request.state.session, "ok", message)
        except (RegistryError, ValueError) as exc:
            ra.flash(request.state.session, "error", str(exc))
        if form.get("arch"):
            back += "?" + urlencode({"arch": form["arch"]})
        return RedirectResponse(back, status_code=303)

    @app.post("/variant/{op}/{name}/accept")
    async def accept(request: Request, op: str, name: str):
        return await write(request, op, name, lambda f: review.accept(
            ra.reg, op, name, f.get("arch") or None))

    @app.post("/variant/{op}/{name}/reject")
    async def reject(request: Request, op: str, name: str):
        return await write(request, op, name, lambda f: review.reject(
            ra.reg, op, name, f.get("why", "")))

    @app.post("/variant/{op}/{name}/lock")
    async def lock(request: Request, op: str, name: str):
        def do(f: dict[str, str]) -> str:
            arch = f.get("arch") or ""
            if not arch:
                raise ValueError("lock needs an arch")
            e = writers.lock(ra.reg, arch, op, name)
            return (f"[{arch}] {op} = {e.variant} (sha256 {e.sha256[:12]}, configs "
                    f"{e.configs_sha256[:12]})")
        return await write(request, op, name, do)
