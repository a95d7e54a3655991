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


def test_a_fused_composite_must_beat_the_composition_of_its_locked_parts(tmp_path, capsys):
    # gated_o_proj has no variant of its own but the gate is locked: serving runs the gate kernel
    # then cuBLAS, so a fused candidate faster than the reference is accepted only if it is also
    # faster than that composition (x_selection, timed beside it by gpu_kernels.py).
    from tests.registry_support import lock_shipped

    reg = lock_shipped(tmp_path / "reg", "attn_output_gate", "triton_v2", ARCH)
    shipped = Registry().variant_path("gated_o_proj", "template_splitk_v1").read_text()

    def fused(name: str, x_ref: tuple[float, ...], x_sel: tuple[float, ...] | None) -> None:
        write_variant(reg, "gated_o_proj", name, shipped + f"# {name}\n")
        path = reg.variant_path("gated_o_proj", name)
        timing = rows(*x_ref)
        if x_sel is not None:
            for row, x in zip(timing, x_sel, strict=True):
                row.update(x_selection=x, selection="composed")
        writers.record(reg, "gated_o_proj", name,
                       [Verification(ARCH, "pass", sha256(path), "cuda", report={"seeds": [0]})],
                       timing)

    fused("slower_than_composed_v1", (1.6, 1.8), (0.8, 0.9))
    fused("never_timed_against_it_v1", (3.0, 3.0), None)
    assert script().main(["--registry", str(reg.root)]) == 0
    out = capsys.readouterr().out
    assert "slower_than_composed_v1 not accepted: x1.70 over the reference, but x0.85 over " \
           "composed: attn_output_gate/triton_v2 + library" in out
    assert "never_timed_against_it_v1 not accepted" in out and "never timed against" in out
    assert "gated_o_proj" not in reg.read_lock().section(ARCH)
    fused("faster_than_both_v1", (2.0, 2.2), (1.2, 1.3))
    assert script().main(["--registry", str(reg.root)]) == 0
    assert "gated_o_proj: accepted and locked faster_than_both_v1" in capsys.readouterr().out
    assert reg.read_lock().section(ARCH)["gated_o_proj"].variant == "faster_than_both_v1"


def test_an_accepted_variant_says_where_it_stands_against_torch_compile(tmp_path, capsys):
    # Beating the reference is the condition; losing to torch.compile is said, not hidden.
    reg = Registry(tmp_path / "reg")
    write_variant(reg, "swiglu", "fast_v1", SOURCES["swiglu"] + "# fast\n")
    path = reg.variant_path("swiglu", "fast_v1")
    rows_ = [{**r, "x_compile": xc} for r, xc in zip(rows(2.0, 3.0), (0.5, 0.8), strict=True)]
    writers.record(reg, "swiglu", "fast_v1",
                   [Verification(ARCH, "pass", sha256(path), "cuda", report={"seeds": [0]})],
                   rows_)
    assert script().main(["--registry", str(reg.root)]) == 0
    out = capsys.readouterr().out
    assert "swiglu: accepted and locked fast_v1" in out
    assert "x0.63 over torch.compile (slower" in out
    assert "torch.compile" in reg.read_record("swiglu", "fast_v1").status_reason


def test_a_kept_variant_takes_its_tuned_configs(tmp_path, capsys):
    # A tune on the GPU proposes configs for the locked variant; no candidate beats it, so it is
    # kept, and its proposal joins configs/ with the lock pinned to it (else the server would
    # keep running the old configs while the proposal waited).
    from model.registry.configs import ConfigTable

    reg = Registry(tmp_path / "reg")
    candidate(reg, "fast_v1", (2.0, 3.0), text="# fast\n")
    writers.accept(reg, "swiglu", "fast_v1", ARCH)
    pinned = reg.read_lock().section(ARCH)["swiglu"]
    table = ConfigTable.from_json({GPU: {"*": {"T=8": {"BLOCK": 64}}}})
    writers.tune(reg, "swiglu", "fast_v1", table, {"gpu": GPU})
    candidate(reg, "slow_v1", (1.5, 1.5), text="# slow\n")
    assert script().main(["--registry", str(reg.root)]) == 0
    out = capsys.readouterr().out
    assert "swiglu: keep fast_v1" in out and f"took fast_v1's tuned configs for {GPU}" in out
    assert reg.read_configs("swiglu", "fast_v1").lookup(GPU, (), 8) == {"BLOCK": 64}
    assert not reg.read_record("swiglu", "fast_v1").proposed_configs
    entry = reg.read_lock().section(ARCH)["swiglu"]
    assert entry.variant == "fast_v1" and entry != pinned  # pinned to the new configs
    # Run again: nothing is proposed, nothing changes.
    assert script().main(["--registry", str(reg.root)]) == 0
    assert "tuned configs" not in capsys.readouterr().out
    assert reg.read_lock().section(ARCH)["swiglu"] == entry


def test_an_unverified_variant_s_proposal_is_not_taken(tmp_path, capsys):
    # The file changed after its tune: its sm_90 verification names other bytes, so the lock's
    # entry is not touched and the proposal waits for a new verification.
    from model.registry.configs import ConfigTable

    reg = Registry(tmp_path / "reg")
    candidate(reg, "fast_v1", (2.0, 3.0), text="# fast\n")
    writers.accept(reg, "swiglu", "fast_v1", ARCH)
    writers.tune(reg, "swiglu", "fast_v1",
                 ConfigTable.from_json({GPU: {"*": {"T=8": {"BLOCK": 64}}}}), {"gpu": GPU})
    path = reg.variant_path("swiglu", "fast_v1")
    path.write_text(path.read_text() + "# edited\n")
    assert script().main(["--registry", str(reg.root)]) == 0
    assert "tuned configs" not in capsys.readouterr().out
    assert reg.read_record("swiglu", "fast_v1").proposed_configs
