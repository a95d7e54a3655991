"""A pytest plugin: each failure's traceback appended to a file the moment the test fails.

The GPU machine's test stage runs under a time limit; a run cut off at the limit never reaches
pytest's summary, where the tracebacks are printed, and leaves only "FAILED" lines. With
AUTOOPT_TEST_FAILURES=FILE every failing test (and every module that fails to collect) writes
its node id and traceback to FILE as soon as it is known. Unset, the plugin does nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "AUTOOPT_TEST_FAILURES"


def _append(nodeid: str, when: str, text: str) -> None:
    path = os.environ.get(ENV)
    if not path:
        return
    with Path(path).open("a", encoding="utf-8") as f:
        f.write(f"==== {nodeid} ({when})\n{text.rstrip()}\n\n")


def pytest_runtest_logreport(report) -> None:
    if report.failed:
        _append(report.nodeid, report.when, report.longreprtext)


def pytest_collectreport(report) -> None:
    if report.failed:
        _append(report.nodeid or "collection", "collect", report.longreprtext)
