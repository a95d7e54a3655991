"""`autoopt review list|show|accept|reject` on a temporary registry, and the registration the
optimize loop does (new immutable files, records, proposed configs, NOTES.md, lock)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autoopt.agents import Proposal
from autoopt.agents.base import OptimizationTask
from autoopt.agents.template import CATALOG
from autoopt.cli import app
from autoopt.loop_eval import RunContext
from autoopt.review import code_key, register_variant, timed_configs
from autoopt.targets import load_target
from model.registry import ConfigTable, Registry, RegistryError

from .agents_support import registry_files


def _flat(text: str) -> str:
    return " ".join(text.split())  # rich wraps long lines at the terminal width


def _register(tmp: Path, op: str, source: str, *, arch: str = "cpu", auto_accept: bool = False,
              speedup: float = 1.4, hint: str = "tiles") -> str:
    reg = Registry(tmp / "registry")
    target = load_target("cpu-tiny" if arch == "cpu" else "h200-tp8-decode")
    ctx = RunContext(run_dir=tmp / "runs" / "r1", registry=reg, target=target, arch=arch,
                     gpu="cpu" if arch == "cpu" else "NVIDIA H200", auto_accept=auto_accept)
    task = OptimizationTask.build(op, hardware={"gpu": "x"}, shapes=[{"T": 1, "I": 128}],
                                  device="cpu", profile_row={"op": op, "time_us": 50.0,
                                                             "calls": 3, "floor_us": 1.0})
    tmp.mkdir(parents=True, exist_ok=True)
    cand = tmp / f"{hint}.py"
    cand.write_text(source)
    proposal = Proposal(source=source, name_hint=hint, notes="Hypothesis: h\n\nPrediction: p",
                        meta={"agent": "claude", "model": "m", "prompt_hash": "abc"})
    report = {"verdict": "pass", "reasons": [], "device": "cpu", "seeds": [0], "shapes": [{}],
              "config": None, "checks": {"numerics": {"passed": True, "outputs": [
                  {"dtype": "torch.bfloat16", "policy": "bitwise", "max_ulp": 0,
                   "mismatches": 0}]}}, "elapsed_s": 1.0}
    rows = [{"shape": {"T": 1, "I": 128}, "median_us": 10.0, "iqr_us": 0.1, "x_reference": 1.4,
             "x_compile": None, "pct_of_floor": 10.0, "meaningful": arch != "cpu",
             "config": {"ROWS": 2}, "device": "cpu", "gpu": None}]
    return register_variant(ctx, task, cand, proposal, reg.sha256(cand), [report], rows,
                            speedup)


def test_registration_writes_new_immutable_files_and_dedupes(tmp_path):
    src = CATALOG["swiglu"][0].render()
    out = _register(tmp_path, "swiglu", src)
    assert out == "registered swiglu/claude_tiles_v1 as candidate"
    reg = Registry(tmp_path / "registry")
    assert (reg.root / "swiglu" / "claude_tiles_v1.py").read_text() == src
    # A candidate's tuned configs wait in its record; configs/ holds accepted ones only.
    assert not reg.config_path("swiglu", "claude_tiles_v1").exists()
    rec = reg.read_record("swiglu", "claude_tiles_v1")
    assert rec.proposed_configs.to_json() == {"cpu": {"I=128": {"T=1": {"ROWS": 2}}}}
    assert rec.provenance.prompt_sha256 == "abc" and rec.verdicts() == {"cpu": "pass"}
    assert "Hypothesis: h" in (reg.root / "swiglu" / "NOTES.md").read_text()
    # The same code again is not a new variant; different code is v2.
    assert "same code as registered" in _register(tmp_path, "swiglu", src)
    v2 = _register(tmp_path, "swiglu", src + "\nV2 = 2\n")
    assert v2.endswith("claude_tiles_v2 as candidate")
    assert not reg.lock_path.exists()


def test_configs_are_stored_as_timed_default_buckets_included():
    # A bucket benchmarked with the default config is stored as {} so that the runtime's
    # nearest-bucket lookup cannot give it another bucket's config it was never timed with.
    rows = [{"shape": {"T": 1}, "config": {"ROWS": 2}}, {"shape": {"T": 64}, "config": None}]
    assert timed_configs(rows) == {"T=1": {"ROWS": 2}, "T=64": {}}


def test_code_key_ignores_comments_and_docstrings_only():
    src = CATALOG["swiglu"][0].render()
    redoc = src.replace('"""', '"""Another header. ', 1) + "\n# a trailing comment\n"
    assert code_key(redoc) == code_key(src)
    assert code_key(src + "\nX = 1\n") != code_key(src)
    assert code_key(src.replace("num_warps", "nwarps")) != code_key(src)
    assert code_key("def broken(:") is None


def test_same_program_with_a_tuned_config_goes_to_the_existing_variant(tmp_path):
    # A template rendering of a registered variant's code (another header) that wins by its
    # config alone: the config and evidence land on that variant; no copy is registered.
    src = CATALOG["swiglu"][0].render()
    first = _register(tmp_path, "swiglu", src, arch="sm_90", auto_accept=True)
    assert first.endswith("claude_tiles_v1 as accepted and locked for sm_90")
    reg = Registry(tmp_path / "registry")
    before = set(reg.variants("swiglu"))
    twin = src.replace('"""', '"""Rendered again with another header. ', 1)
    out = _register(tmp_path, "swiglu", twin, arch="sm_90", auto_accept=True, hint="again")
    assert out.startswith("registered swiglu/claude_tiles_v1 tuned configs (the same program")
    assert "locked for sm_90" in out
    assert set(reg.variants("swiglu")) == before
    configs = reg.read_configs("swiglu", "claude_tiles_v1")
    assert configs.to_json() == {"NVIDIA H200": {"I=128": {"T=1": {"ROWS": 2}}}}
    rec = reg.read_record("swiglu", "claude_tiles_v1")
    assert rec.tunings[-1]["configs"] == {"NVIDIA H200": {"I=128": {"T=1": {"ROWS": 2}}}}
    assert rec.tunings[-1]["verification"][0]["verdict"] == "pass"
    assert "claude_tiles_v1: tuned configs" in (reg.root / "swiglu" / "NOTES.md").read_text()
    entry = reg.read_lock().section("sm_90")["swiglu"]
    assert entry.variant == "claude_tiles_v1" and entry.configs_sha256 == configs.sha256
    # On the CPU the timings judge nothing: the existing variant is left as it was.
    cpu = _register(tmp_path / "cpu", "swiglu", src)
    assert cpu.endswith("as candidate")
    files = {p: p.read_bytes() for p in registry_files(tmp_path / "cpu" / "registry")}
    out = _register(tmp_path / "cpu", "swiglu", twin, hint="again")
    assert "nothing was written" in out
    assert files == {p: p.read_bytes() for p in registry_files(tmp_path / "cpu" / "registry")}


def test_auto_accept_locks_gpu_winners_but_never_cpu_ones(tmp_path):
    src = CATALOG["swiglu"][0].render()
    assert _register(tmp_path / "a", "swiglu", src, auto_accept=True).endswith("as candidate")
    out = _register(tmp_path / "b", "swiglu", src, arch="sm_90", auto_accept=True)
    assert out == "registered swiglu/claude_tiles_v1 as accepted and locked for sm_90"
    reg = Registry(tmp_path / "b" / "registry")
    assert reg.read_lock().section("sm_90")["swiglu"].variant == "claude_tiles_v1"
    # Accepted: its configs moved from the record into configs/, and the lock pins them.
    assert reg.read_configs("swiglu", "claude_tiles_v1") == ConfigTable.from_rows(
        "swiglu", "NVIDIA H200", [{"shape": {"T": 1, "I": 128}, "config": {"ROWS": 2}}])
    assert not reg.read_record("swiglu", "claude_tiles_v1").proposed_configs


def test_review_list_show_accept_reject(tmp_path):
    src = CATALOG["swiglu"][0].render()
    _register(tmp_path, "swiglu", src)
    _register(tmp_path, "swiglu", src + "\nOTHER = 1\n", hint="other")
    reg_dir = str(tmp_path / "registry")
    cli = CliRunner()
    res = cli.invoke(app, ["review", "list", "--registry", reg_dir])
    assert res.exit_code == 0
    assert "claude_tiles_v1" in res.output and "claude_other_v1" in res.output
    res = cli.invoke(app, ["review", "show", "swiglu", "claude_tiles_v1", "--registry", reg_dir])
    assert res.exit_code == 0, res.output
    for part in ("## Source", "## Diff against reference", "+def run(", "-def reference(",
                 "## Verification", "## Timings", "## Profile delta", "not meaningful"):
        assert part in res.output, part
    before = {p: p.read_bytes() for p in registry_files(tmp_path / "registry")}
    res = cli.invoke(app, ["review", "accept", "swiglu", "claude_tiles_v1", "--registry", reg_dir])
    assert res.exit_code == 0, res.output
    reg = Registry(reg_dir)
    assert reg.read_lock().section("cpu")["swiglu"].variant == "claude_tiles_v1"
    rec = reg.read_record("swiglu", "claude_tiles_v1")
    assert rec.status == "accepted" and rec.review[-1]["action"] == "accept"
    # Plain files: the record, its configs (moved out of the record) and the lock changed,
    # nothing else (what `git diff kernels/` shows).
    after = {p: p.read_bytes() for p in registry_files(tmp_path / "registry")}
    changed = {str(p.relative_to(tmp_path / "registry")) for p in after
               if before.get(p) != after[p]}
    assert changed == {"swiglu/records/claude_tiles_v1.json", "swiglu/configs/claude_tiles_v1.json",
                       "registry.lock.toml"}
    # Now the diff is against the selected variant.
    res = cli.invoke(app, ["review", "show", "swiglu", "claude_other_v1", "--registry", reg_dir])
    assert "## Diff against claude_tiles_v1" in res.output
    res = cli.invoke(app, ["review", "reject", "swiglu", "claude_tiles_v1", "--why",
                           "slower at T=64 on the H200", "--registry", reg_dir])
    assert res.exit_code == 0 and "removed from the lock for cpu" in _flat(res.output)
    rec = reg.read_record("swiglu", "claude_tiles_v1")
    assert rec.status == "rejected" and rec.status_reason == "slower at T=64 on the H200"
    assert "swiglu" not in reg.read_lock().section("cpu")
    res = cli.invoke(app, ["review", "list", "--registry", reg_dir, "--status", "rejected"])
    assert "claude_tiles_v1" in res.output and "claude_other_v1" not in res.output


def test_review_errors_say_what_to_do(tmp_path):
    _register(tmp_path, "swiglu", CATALOG["swiglu"][0].render())
    reg_dir = str(tmp_path / "registry")
    res = CliRunner().invoke(app, ["review", "show", "swiglu", "nope", "--registry", reg_dir])
    assert res.exit_code == 1 and "variants of swiglu: claude_tiles_v1" in _flat(res.output)
    res = CliRunner().invoke(app, ["review", "accept", "swiglu", "claude_tiles_v1", "--arch",
                                   "sm_90", "--registry", reg_dir])
    assert res.exit_code == 1 and "verified for ['cpu'], not sm_90" in _flat(res.output)
    from autoopt.review import reject

    with pytest.raises(RegistryError, match="needs a reason"):
        reject(Registry(reg_dir), "swiglu", "claude_tiles_v1", " ")
    assert json.loads((Path(reg_dir) / "swiglu" / "records" / "claude_tiles_v1.json").read_text(
    ))["status"] == "candidate"
