"""tests/failure_log.py: a failing test's traceback reaches the file before pytest's summary."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pytest(tmp_path: Path, log: Path | None) -> subprocess.CompletedProcess:
    (tmp_path / "test_sample.py").write_text(
        "def test_ok():\n    assert True\n\n\n"
        "def test_bad():\n    assert 1 + 1 == 3, 'arithmetic'\n")
    (tmp_path / "test_broken.py").write_text("import no_such_module_anywhere\n")
    env = {k: v for k, v in os.environ.items() if k != "AUTOOPT_TEST_FAILURES"}
    if log is not None:
        env["AUTOOPT_TEST_FAILURES"] = str(log)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.failure_log",
                           "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                           "--continue-on-collection-errors", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_failures_and_collection_errors_are_written_as_they_happen(tmp_path):
    log = tmp_path / "failures.log"
    res = _pytest(tmp_path, log)
    assert res.returncode == 1, res.stdout + res.stderr
    text = log.read_text()
    assert "test_sample.py::test_bad (call)" in text and "arithmetic" in text
    assert "test_broken.py (collect)" in text and "no_such_module_anywhere" in text
    assert "test_ok" not in text


def test_nothing_is_written_without_the_variable(tmp_path):
    res = _pytest(tmp_path, None)
    assert res.returncode == 1
    assert not (tmp_path / "failures.log").exists()
