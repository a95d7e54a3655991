"""The demo checkpoint `autoopt serve` writes on first use: atomically, and repaired when an
earlier writer died half way."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from model.demo import COMPLETE_MARKER, DEMO_FILES, ensure_demo_checkpoint, is_complete_demo
from model.serve.engine import EngineConfig, LLMEngine, SamplingParams

REPO = Path(__file__).resolve().parent.parent
# A writer that stops for good after the weights: the process is killed while it waits.
STALLING_WRITER = """
import sys, time
import model.demo as demo
real = demo.save_file
def save_file(*args, **kwargs):
    real(*args, **kwargs)
    print("weights written", flush=True)
    time.sleep(600)
demo.save_file = save_file
demo.ensure_demo_checkpoint(sys.argv[1])
"""


def serves(path: Path) -> bool:
    eng = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32",
                                 kernels="reference", max_num_seqs=1, max_model_len=64))
    out = eng.generate([eng.tokenizer.encode("Hello")], SamplingParams(max_tokens=2))[0]
    return len(out.token_ids) == 2


def test_first_use_writes_a_complete_checkpoint_and_reuses_it(tmp_path):
    path = ensure_demo_checkpoint(tmp_path / "demo")
    assert is_complete_demo(path) and {p.name for p in path.iterdir()} >= DEMO_FILES
    assert not list(tmp_path.glob(".demo.partial-*"))
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_demo_checkpoint(path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # not written twice


def test_a_writer_killed_half_way_leaves_nothing_that_looks_complete(tmp_path):
    path = tmp_path / "demo"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", STALLING_WRITER, str(path)], env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "weights written"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert not path.exists()  # the half-written copy never took the checkpoint's name
    assert list(tmp_path.glob(".demo.partial-*"))
    ensure_demo_checkpoint(path)
    assert is_complete_demo(path) and not list(tmp_path.glob(".demo.partial-*"))
    assert serves(path)


def test_a_partial_checkpoint_from_an_older_writer_is_rebuilt(tmp_path, caplog):
    path = tmp_path / "demo"
    path.mkdir()
    (path / "config.json").write_text("{}")  # what a writer killed early left behind
    (path / "model.safetensors").write_bytes(b"\x00" * 100)
    ensure_demo_checkpoint(path)
    assert is_complete_demo(path) and "rebuilding" in caplog.text
    assert serves(path)


def test_a_directory_with_other_files_is_never_deleted(tmp_path):
    path = tmp_path / "demo"
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "my-notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="my-notes.txt"):
        ensure_demo_checkpoint(path)
    assert (path / "my-notes.txt").read_text() == "keep me"
    assert not (path / COMPLETE_MARKER).exists()


def test_concurrent_first_uses_write_once(tmp_path):
    path = tmp_path / "demo"
    code = "import sys, model.demo as d; print(d.ensure_demo_checkpoint(sys.argv[1]))"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path)], env=env,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    deadline = time.monotonic() + 120
    outs = [p.communicate(timeout=max(deadline - time.monotonic(), 1))[0] for p in procs]
    assert all(p.returncode == 0 for p in procs) and all(str(path) in o for o in outs)
    assert is_complete_demo(path) and not list(tmp_path.glob(".demo.partial-*"))
