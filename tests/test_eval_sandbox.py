"""The sandbox child: audit hook, timeout, crashes, environment; and verify's import failures."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from autoopt.eval.sandbox import run_child
from autoopt.eval.verify import verify_variant

# Reaches the hook only because these tests bypass the static screen (run_child directly).
HOSTILE = '''
import os
import subprocess  # already loaded by the harness: no import event, its calls are blocked


def _socket():
    import socket  # not loaded yet: the import itself is refused

    socket.create_connection(("127.0.0.1", 9))


def run(config=None):
    done = []
    for name, act in [
        ("subprocess", lambda: subprocess.run(["true"])),
        ("socket", _socket),
        ("write", lambda: open(os.environ["TARGET"], "w")),
        ("remove", lambda: os.remove(os.environ["TARGET"] + ".keep")),
        ("system", lambda: os.system("true")),
    ]:
        try:
            act()
            done.append(name)
        except PermissionError:
            pass
    with open(__file__) as f:  # reading is not blocked (imports read files too)
        f.read(1)
    return done
'''


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_audit_hook_blocks_candidate_side_effects(tmp_path, monkeypatch):
    target = tmp_path / "written.txt"
    keep = tmp_path / "written.txt.keep"
    keep.write_text("stay")
    monkeypatch.setenv("TARGET", str(target))
    src = _write(tmp_path, "hostile.py", HOSTILE)
    res = run_child("echo", {"source": str(src)}, timeout_s=60)
    assert res.ok, res.error
    assert res.result["returned"] == "[]"  # nothing got through
    events = " ".join(res.blocked)
    for ev in ("subprocess.Popen", "import ('socket'", "open", "os.remove", "os.system"):
        assert ev in events, res.blocked
    assert not target.exists() and keep.read_text() == "stay"


def test_timeout_kills_the_child(tmp_path):
    src = _write(tmp_path, "hang.py", "def run(config=None):\n    while True:\n        pass\n")
    res = run_child("echo", {"source": str(src)}, timeout_s=8)
    assert res.timed_out and not res.ok
    assert res.error.startswith("timeout after 8 s") and res.elapsed_s < 30


def test_a_crashing_child_is_reported(tmp_path):
    src = _write(tmp_path, "crash.py", "import os\n\ndef run(config=None):\n    os._exit(3)\n")
    res = run_child("echo", {"source": str(src)}, timeout_s=60)
    assert not res.ok and res.returncode == 3
    assert "without a result" in res.error


def test_child_environment(monkeypatch):
    monkeypatch.setenv("FAKE_API_KEY", "secret")
    monkeypatch.setenv("SOME_TOKEN", "secret")
    res = run_child("echo", {}, timeout_s=60, device="cpu")
    assert res.ok
    assert res.result["secret_keys"] == []  # credentials never reach candidate code
    assert res.result["env"] == {"TRITON_INTERPRET": "1", "MALLOC_PERTURB_": "128",
                                 "OMP_NUM_THREADS": "1"}


def test_unknown_job_is_refused():
    with pytest.raises(ValueError, match="unknown sandbox job"):
        run_child("nope", {}, timeout_s=1)


def test_import_error_is_a_rejection(tmp_path):
    src = _write(tmp_path, "broken.py", "import torch\n\nX = 1 / 0\n\ndef run(g, u, config=None):\n"
                                        "    return g\n")
    rep = verify_variant("swiglu", src, seeds=(0,), shapes=[{"T": 3, "I": 8}], timeout_s=120)
    assert rep.verdict == "reject"
    assert rep.reasons == ["import failed: ZeroDivisionError: division by zero"]


def test_unknown_op_and_missing_file_raise(tmp_path):
    with pytest.raises(ValueError, match="unknown op"):
        verify_variant("nope", tmp_path / "x.py")
    with pytest.raises(FileNotFoundError):
        verify_variant("swiglu", tmp_path / "missing.py")
