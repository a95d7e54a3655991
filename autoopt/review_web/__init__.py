"""`autoopt review serve`: review agent-written kernels in a browser, evidence beside the diff.

    security.py  the start-up token, session cookie, CSRF token, Host and Origin checks
    app.py       the FastAPI app: routes, error pages, the three writes (accept, reject, lock)
    pages.py     what each page shows, read through the CLI's own functions
    evidence.py  a record's verification (per arch, per shape) and timings (per token bucket)
    sources.py   highlighted source and the side-by-side diff (pygments, difflib)
    plots.py     time per token bucket as SVG (matplotlib, drawn on the server)
    runs.py      optimize runs: state, attempts, reports, plots, transcripts
    markup.py    markdown (reports, NOTES.md) to HTML without active content
    server.py    bind, print the URL with its token, serve (uvicorn)

Pages are server-rendered from the package's templates/ and static/ (no scripts, no build
step, nothing loaded from elsewhere). Every write goes through the functions the CLI calls
(`autoopt.review.accept` / `reject`, `model.registry.writers.lock`), so the page and
`autoopt review ...` leave the same files behind.
"""

from __future__ import annotations

from .app import create_app
from .runs import Runs
from .security import Guard
from .server import prepare, serve

__all__ = ["Guard", "Runs", "create_app", "prepare", "serve"]
