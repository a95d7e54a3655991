"""The registry store: records and their schema, immutability, the writers, the lock, seeding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model.registry import (
    ConfigTable,
    Lock,
    Record,
    Registry,
    RegistryError,
    Verification,
    shipped_root,
    writers,
)
from model.registry.runtime import check_evidence

from .registry_support import TORCH_RMSNORM, TORCH_SWIGLU, passing, torch_registry, write_variant


@pytest.fixture
def reg(tmp_path: Path) -> Registry:
    r = Registry(tmp_path / "kernels")
    write_variant(r, "rmsnorm", "torch_v1", TORCH_RMSNORM)
    write_variant(r, "swiglu", "torch_v1", TORCH_SWIGLU)
    return r


def test_variants_and_paths(reg):
    assert reg.ops() == ["rmsnorm", "swiglu"]
    assert reg.variants("rmsnorm") == ["torch_v1"]
    variant, data = reg.read_variant("rmsnorm", "torch_v1")
    assert variant.language == "torch" and variant.runs_on_cpu and data.startswith(b"\nimport")
    for bad in ("../evil", "a/b", "1abc", ""):
        with pytest.raises(RegistryError, match="plain identifier"):
            reg.variant_path("rmsnorm", bad)


def test_record_pins_the_file_and_a_recorded_file_is_immutable(reg):
    rec = writers.record(reg, "rmsnorm", "torch_v1", [passing(reg, "rmsnorm", "torch_v1")])
    assert rec.status == "candidate" and rec.provenance.agent == "hand-written"
    assert reg.read_record("rmsnorm", "torch_v1") == rec
    assert reg.check_immutable() == []
    path = reg.variant_path("rmsnorm", "torch_v1")
    path.write_text(path.read_text() + "\n# edited after recording\n")
    assert [(p.op, p.kind) for p in reg.check_immutable()] == [("rmsnorm", "modified")]
    with pytest.raises(RegistryError, match="immutable"):
        writers.record(reg, "rmsnorm", "torch_v1", [])
    path.unlink()
    assert [p.kind for p in reg.check_immutable()] == ["missing"]


def test_register_writes_a_new_file_never_over_an_old_one(reg, tmp_path):
    src = TORCH_SWIGLU.replace("F.silu", "torch.nn.functional.silu").encode()
    check = Verification("cpu", "pass", writers.Variant.from_source("swiglu", "x", src).sha256)
    rec = writers.register(reg, "swiglu", "agent_v1", src, writers.provenance("claude"), [check])
    assert rec.status == "candidate" and reg.read_variant("swiglu", "agent_v1")[1] == src
    with pytest.raises(RegistryError, match="never overwritten"):
        writers.register(reg, "swiglu", "agent_v1", src, writers.provenance("claude"), [check])
    other = Verification("cpu", "pass", "0" * 64)
    with pytest.raises(RegistryError, match="not the file's"):
        writers.register(reg, "swiglu", "agent_v2", src, writers.provenance("claude"), [other])


def test_status_changes(reg):
    with pytest.raises(RegistryError, match="no record"):
        writers.set_status(reg, "rmsnorm", "torch_v1", "accepted")
    writers.record(reg, "rmsnorm", "torch_v1", [Verification(
        "cpu", "reject", reg.read_variant("rmsnorm", "torch_v1")[0].sha256, reasons=("bad",))])
    with pytest.raises(RegistryError, match="status"):
        writers.set_status(reg, "rmsnorm", "torch_v1", "great")
    with pytest.raises(RegistryError, match="no passing verification"):
        writers.set_status(reg, "rmsnorm", "torch_v1", "accepted")
    with pytest.raises(RegistryError, match="needs a reason"):
        writers.reject(reg, "rmsnorm", "torch_v1", " ")
    rec = writers.set_status(reg, "rmsnorm", "torch_v1", "rejected", "slower")
    assert rec.status_reason == "slower" and rec.review[-1]["action"] == "reject"


def test_lock_needs_an_accepted_variant_verified_on_that_arch(reg):
    with pytest.raises(RegistryError, match="no record"):
        writers.lock(reg, "cpu", "rmsnorm", "torch_v1")
    writers.record(reg, "rmsnorm", "torch_v1", [passing(reg, "rmsnorm", "torch_v1")])
    with pytest.raises(RegistryError, match="'candidate', not 'accepted'"):
        writers.lock(reg, "cpu", "rmsnorm", "torch_v1")
    writers.set_status(reg, "rmsnorm", "torch_v1", "accepted")
    with pytest.raises(RegistryError, match="no passing verification on sm_90"):
        writers.lock(reg, "sm_90", "rmsnorm", "torch_v1")
    entry = writers.lock(reg, "cpu", "rmsnorm", "torch_v1")
    assert reg.read_lock().section("cpu")["rmsnorm"] == entry
    assert entry.configs_sha256 == ConfigTable().sha256  # no tuned configs, pinned as such
    path = reg.variant_path("rmsnorm", "torch_v1")
    path.write_text(path.read_text() + "# changed\n")
    with pytest.raises(RegistryError, match="changed since it was recorded"):
        writers.lock(reg, "cpu", "rmsnorm", "torch_v1")
    assert writers.unlock(reg, "cpu", "rmsnorm") and reg.read_lock().section("cpu") == {}


def test_lock_text_round_trips_and_old_entries_are_problems(tmp_path):
    reg = torch_registry(tmp_path / "k")
    lock = reg.read_lock()
    assert Lock.parse(lock.to_toml()).sections == lock.sections
    text = ('[cpu]\nrmsnorm = { variant = "torch_v1", sha256 = "' + "a" * 64 + '" }\n'
            '[bogus-arch]\nx = { variant = "v", sha256 = "b", configs_sha256 = "c" }\n')
    parsed = Lock.parse(text)
    assert parsed.sections == {} and len(parsed.problems) == 2
    assert "configs_sha256" in parsed.problems[0] and "migrate" in parsed.problems[0]


def test_record_json_round_trip_and_schema_check(reg):
    rec = writers.record(reg, "swiglu", "torch_v1", [passing(reg, "swiglu", "torch_v1")],
                         [{"shape": {"T": 1, "I": 8}, "median_us": 1.0, "gpu": "cpu"}])
    data = json.loads(reg.record_path("swiglu", "torch_v1").read_text())
    assert Record.from_json(data) == rec and data["schema"] == 2
    with pytest.raises(RegistryError, match="schema 1.*registry migrate"):
        Record.from_json({**data, "schema": 1})
    with pytest.raises(RegistryError, match="unknown keys"):
        Record.from_json({**data, "archs": ["sm_90"]})
    with pytest.raises(TypeError):
        rec.verification["cpu"][0].report["seeds"] = [9]  # records are deep-frozen


def test_verdict_is_per_arch_and_per_file(reg):
    rec = writers.record(reg, "swiglu", "torch_v1", [passing(reg, "swiglu", "torch_v1")])
    other = Verification("sm_90", "pass", "1" * 64)  # another file's verification
    with pytest.raises(RegistryError, match="not the file's"):
        writers.record(reg, "swiglu", "torch_v1", [other])
    stale = rec.with_verification(other)  # only a hand-made record holds one
    assert stale.verdicts() == {"cpu": "pass", "sm_90": "stale"}
    sha = rec.variant.sha256
    assert stale.verified("cpu", sha) and not stale.verified("sm_90", sha)
    rec = writers.record(reg, "swiglu", "torch_v1", [Verification("sm_90", "reject", sha)])
    assert rec.verdicts() == {"cpu": "pass", "sm_90": "reject"}  # replaced sm_90's entries


def test_candidate_configs_stay_in_the_record_until_accepted(reg):
    writers.record(reg, "rmsnorm", "torch_v1", [passing(reg, "rmsnorm", "torch_v1")])
    rows = [{"shape": {"T": 1, "H": 64}, "config": {"BLOCK": 32}},
            {"shape": {"T": 64, "H": 64}, "config": None}]
    table = ConfigTable.from_rows("rmsnorm", "cpu", rows)
    rec = writers.tune(reg, "rmsnorm", "torch_v1", table, {"run": "r1"})
    assert rec.proposed_configs == table and not reg.config_path("rmsnorm", "torch_v1").exists()
    assert rec.tunings[-1]["run"] == "r1"
    writers.accept(reg, "rmsnorm", "torch_v1", "cpu")
    assert reg.read_configs("rmsnorm", "torch_v1") == table
    assert not reg.read_record("rmsnorm", "torch_v1").proposed_configs
    entry = reg.read_lock().section("cpu")["rmsnorm"]
    assert entry.configs_sha256 == table.sha256
    # A later accepted tuning re-pins every lock entry of the variant.
    more = ConfigTable.from_rows("rmsnorm", "cpu", [{"shape": {"T": 8, "H": 128},
                                                     "config": {"BLOCK": 128}}])
    writers.tune(reg, "rmsnorm", "torch_v1", more, {"run": "r2"})
    writers.accept(reg, "rmsnorm", "torch_v1", "cpu")
    assert reg.read_lock().section("cpu")["rmsnorm"].configs_sha256 == \
        reg.read_configs("rmsnorm", "torch_v1").sha256 != table.sha256
    assert len(reg.read_configs("rmsnorm", "torch_v1").entries) == 3


def test_the_shipped_registry_is_read_only_and_a_seeded_one_copies_on_first_write(tmp_path):
    seed = torch_registry(tmp_path / "shipped").root
    ro = Registry(seed, read_only=True)
    with pytest.raises(RegistryError, match="read-only.*--registry DIR"):
        writers.set_status(ro, "swiglu", "torch_v1", "candidate")
    user = Registry(tmp_path / "user" / "registry", seed=seed)
    assert user.root == seed and user.ops() == ["rmsnorm", "swiglu"]  # reads the seed
    writers.reject(user, "swiglu", "torch_v1", "not for me")
    assert user.root == tmp_path / "user" / "registry"
    assert user.read_record("swiglu", "torch_v1").status == "rejected"
    assert Registry(seed).read_record("swiglu", "torch_v1").status == "accepted"  # untouched
    assert "swiglu" not in user.read_lock().section("cpu")


def test_repo_registry_is_consistent():
    # Every committed record reads under schema 2 and still matches its file; every lock entry
    # holds its evidence (the file, an accepted record verified there, the pinned configs).
    repo = Registry(shipped_root())
    assert repo.check_immutable() == []
    for op in repo.ops():
        for name in repo.names(op):
            assert repo.read_record(op, name) is not None, (op, name)
    lock = repo.read_lock(missing_ok=False)
    assert lock.problems == () and "sm_90" in lock.sections
    for arch, op, entry in lock.entries():
        assert not isinstance(check_evidence(repo, op, entry, arch), str), (arch, op)
    assert not repo.variant_path("norm_residual_norm", "template_rowsum_v1").exists()
