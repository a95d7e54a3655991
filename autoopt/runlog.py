"""Progress of a long command as plain timestamped lines: the run's `run.log` and stderr.

Spinners print nothing without a terminal; a run started under nohup, in CI or by an agent must
still be followable, so every stage's start, end and outcome is one line with the time, written
to the run directory's log file (flushed per line) and to stderr.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

FORMAT = "%(asctime)s %(message)s"
DATEFMT = "%Y-%m-%d %H:%M:%S"
_NAME = "autoopt.run"


def logger() -> logging.Logger:
    return logging.getLogger(_NAME)


@contextmanager
def run_log(path: Path | None, stream=None) -> Iterator[logging.Logger]:
    """Inside, `logger()` writes to `path` (appended: a resumed run continues its log) and to
    `stream` (default: stderr); the handlers are removed on exit."""
    log = logger()
    log.setLevel(logging.INFO)
    log.propagate = False
    fmt = logging.Formatter(FORMAT, DATEFMT)
    handlers: list[logging.Handler] = [logging.StreamHandler(stream or sys.stderr)]
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(path, mode="a", encoding="utf-8"))
    for h in handlers:
        h.setFormatter(fmt)
        log.addHandler(h)
    try:
        yield log
    finally:
        for h in handlers:
            log.removeHandler(h)
            h.close()


def say(text: str) -> None:
    logger().info(text)


@contextmanager
def stage(name: str) -> Iterator[None]:
    """'<name>: started' and '<name>: done in N s' (or 'failed after N s: ...') lines."""
    t0 = time.monotonic()
    say(f"{name}: started")
    try:
        yield
    except BaseException as e:
        say(f"{name}: stopped after {time.monotonic() - t0:.1f} s ({type(e).__name__}: {e})")
        raise
    say(f"{name}: done in {time.monotonic() - t0:.1f} s")
