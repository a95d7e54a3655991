"""benchmarks/gpu_accept.py: after records come back from a GPU, each op's fastest verified
candidate is accepted and locked for that arch; nothing without evidence there is."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from model.registry import Registry, Verification, writers
from tests.registry_support import SOURCES, sha256, write_variant

ROOT = Path(__file__).resolve().parents[1]
ARCH, GPU = "sm_90", "NVIDIA H200"


def script():
    spec = importlib.util.spec_from_file_location("gpu_accept", ROOT / "benchmarks" /
                                                  "gpu_accept.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rows(*xs: float) -> list[dict]:
    return [{"shape": {"T": 2**i}, "impl": "variant", "gpu": GPU, "meaningful": True,
             "x_reference": x} for i, x in enumerate(xs)]


def candidate(reg: Registry, name: str, xs: tuple[float, ...] = (), arch: str | None = ARCH,
              text: str = "") -> None:
    write_variant(reg, "swiglu", name, SOURCES["swiglu"] + text)
    path = reg.variant_path("swiglu", name)
    checks = [Verification(arch, "pass", sha256(path), "cuda", report={"seeds": [0]})] \
        if arch else []
    writers.record(reg, "swiglu", name, checks, rows(*xs))


def test_the_fastest_verified_candidate_is_accepted_and_locked(tmp_path, capsys):
    reg = Registry(tmp_path / "reg")
    candidate(reg, "slow_v1", (1.2, 1.5), text="# slow\n")
    candidate(reg, "fast_v1", (2.0, 3.0), text="# fast\n")
    candidate(reg, "faster_unverified_v1", (9.0, 9.0), arch=None, text="# unverified\n")
    candidate(reg, "faster_elsewhere_v1", (9.0, 9.0), arch="sm_100", text="# other arch\n")
    candidate(reg, "slower_than_reference_v1", (0.5, 0.9), text="# slower\n")
    before = tmp_path / "before.lock.toml"
    assert script().main(["--registry", str(reg.root), "--before-lock", str(before),
                          "--before", "swiglu=faster_unverified_v1"]) == 0
    out = capsys.readouterr().out
    assert "swiglu=faster_unverified_v1 not pinned" in out  # no sm_90 evidence: not in "before"
    assert "swiglu: accepted and locked fast_v1" in out
    entry = reg.read_lock().section(ARCH)["swiglu"]
    assert entry.variant == "fast_v1"
    assert reg.read_record("swiglu", "fast_v1").status == "accepted"
    assert reg.read_lock(before).section(ARCH) == {}  # the selection before: the reference
    for name in ("slow_v1", "faster_unverified_v1", "faster_elsewhere_v1",
                 "slower_than_reference_v1"):
        assert reg.read_record("swiglu", name).status == "candidate", name


def test_a_locked_variant_is_kept_when_no_candidate_beats_it(tmp_path, capsys):
    reg = Registry(tmp_path / "reg")
    candidate(reg, "fast_v1", (2.0, 3.0), text="# fast\n")
    writers.accept(reg, "swiglu", "fast_v1", ARCH)
    candidate(reg, "slow_v1", (1.5, 1.5), text="# slow\n")
    assert script().main(["--registry", str(reg.root)]) == 0
    assert "swiglu: keep fast_v1" in capsys.readouterr().out
    assert reg.read_lock().section(ARCH)["swiglu"].variant == "fast_v1"
    assert reg.read_record("swiglu", "slow_v1").status == "candidate"
