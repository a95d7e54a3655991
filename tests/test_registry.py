"""The registry store (records, immutability, configs, the lock) and runtime dispatch refusals."""

from __future__ import annotations

import json
import logging
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from model.ops import CONTRACTS
from model.registry import (
    DEFAULT_ROOT,
    KernelCall,
    KernelRefusedWarning,
    Registry,
    RegistryError,
    current_arch,
    new_record,
    resolve_ops,
    sha256,
)

# A plain-torch rmsnorm variant: the reference's formula, written out (honest, CPU-friendly).
TORCH_RMSNORM = '''
import torch

DEFAULT_CONFIG = {"BLOCK": 64}
SEEN = []


def run(x, weight, eps, config=None):
    SEEN.append(config)
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * (xf * r)).to(x.dtype)
'''
TORCH_SWIGLU = '''
import torch
import torch.nn.functional as F


def run(gate, up, config=None):
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)
'''


@pytest.fixture
def reg(tmp_path: Path) -> Registry:
    r = Registry(tmp_path / "kernels")
    for op, name, src in (("rmsnorm", "torch_v1", TORCH_RMSNORM),
                          ("swiglu", "torch_v1", TORCH_SWIGLU)):
        path = r.variant_path(op, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(src)
    return r


def lock_both(reg: Registry, arch: str = "cpu") -> None:
    reg.write_lock({arch: {op: {"variant": "torch_v1",
                                "sha256": sha256(reg.variant_path(op, "torch_v1"))}
                           for op in ("rmsnorm", "swiglu")}})


def refusals(record: list) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, KernelRefusedWarning)]


def resolve(reg: Registry, **kw):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        table = resolve_ops("tuned", reg.root, arch="cpu", device="cpu", **kw)
    return table, refusals(record)


# ---- store ------------------------------------------------------------------------------------
def test_variants_and_paths(reg):
    assert reg.ops() == ["rmsnorm", "swiglu"]
    assert reg.variants("rmsnorm") == ["torch_v1"]
    assert reg.variant_path("rmsnorm", "torch_v1").name == "torch_v1.py"
    with pytest.raises(RegistryError, match="plain identifier"):
        reg.variant_path("rmsnorm", "../evil")


def test_record_pins_the_file_hash_and_detects_a_change(reg):
    path = reg.variant_path("rmsnorm", "torch_v1")
    rec = new_record("rmsnorm", "torch_v1", sha256(path), agent="hand-written")
    reg.write_record("rmsnorm", "torch_v1", rec)
    stored = reg.read_record("rmsnorm", "torch_v1")
    assert stored["sha256"] == sha256(path) and stored["status"] == "candidate"
    assert stored["provenance"]["agent"] == "hand-written"
    assert reg.check_immutable() == []
    path.write_text(path.read_text() + "\n# edited after recording\n")
    problems = reg.check_immutable()
    assert [(p.op, p.variant, p.kind) for p in problems] == [("rmsnorm", "torch_v1", "modified")]
    with pytest.raises(RegistryError, match="immutable"):
        reg.write_record("rmsnorm", "torch_v1", stored)
    path.unlink()
    assert [p.kind for p in reg.check_immutable()] == ["missing"]


def test_status_must_be_known(reg):
    reg.write_record("rmsnorm", "torch_v1", new_record(
        "rmsnorm", "torch_v1", sha256(reg.variant_path("rmsnorm", "torch_v1")), agent="x"))
    with pytest.raises(RegistryError, match="status"):
        reg.set_status("rmsnorm", "torch_v1", "great")
    assert reg.set_status("rmsnorm", "torch_v1", "rejected", "slower")["status_reason"] == "slower"


def test_set_lock_refuses_unaccepted_and_modified_variants(reg):
    path = reg.variant_path("rmsnorm", "torch_v1")
    with pytest.raises(RegistryError, match="no record"):
        reg.set_lock("cpu", "rmsnorm", "torch_v1")
    reg.write_record("rmsnorm", "torch_v1", new_record("rmsnorm", "torch_v1", sha256(path),
                                                       agent="hand-written"))
    with pytest.raises(RegistryError, match="'candidate', not 'accepted'"):
        reg.set_lock("cpu", "rmsnorm", "torch_v1")
    reg.set_status("rmsnorm", "torch_v1", "accepted", "faster")
    entry = reg.set_lock("cpu", "rmsnorm", "torch_v1")
    assert entry.sha256 == sha256(path)
    assert reg.lock("cpu")["rmsnorm"] == entry
    assert "[cpu]" in reg.lock_path.read_text()
    path.write_text(path.read_text() + "# changed\n")
    with pytest.raises(RegistryError, match="changed since it was recorded"):
        reg.set_lock("sm_90", "rmsnorm", "torch_v1")
    assert reg.unset_lock("cpu", "rmsnorm") and reg.lock("cpu") == {}


def test_lock_round_trips_through_toml(reg):
    lock_both(reg, "sm_90")
    data = reg.read_lock()
    assert set(data) == {"sm_90"} and set(data["sm_90"]) == {"rmsnorm", "swiglu"}
    assert reg.lock("sm_90")["swiglu"].variant == "torch_v1"
    assert reg.lock("cpu") == {}


def test_repo_registry_is_consistent():
    # Every recorded variant in the repo's kernels/ still matches its record; the lock parses.
    repo = Registry(DEFAULT_ROOT)
    assert repo.check_immutable() == []
    for arch in repo.read_lock():
        for op, entry in repo.lock(arch).items():
            assert sha256(repo.variant_path(op, entry.variant)) == entry.sha256, (arch, op)


# ---- dispatch ----------------------------------------------------------------------------------
def test_locked_variants_are_dispatched(reg):
    lock_both(reg)
    table, refused = resolve(reg)
    assert refused == []
    assert table.sources["rmsnorm"].startswith("torch_v1 (")
    assert table.sources["attention"] == "reference"
    x, w, eps = CONTRACTS["rmsnorm"].make_inputs({"T": 5, "H": 64}, 0)
    assert torch.equal(table.rmsnorm(x, w, eps), CONTRACTS["rmsnorm"].reference(x, w, eps))


def test_reference_ignores_the_lock(reg):
    lock_both(reg)
    table = resolve_ops("reference", reg.root)
    assert set(table.sources.values()) == {"reference"}


def test_missing_arch_falls_back_to_reference_without_warning(reg):
    lock_both(reg, "sm_90")
    table, refused = resolve(reg)
    assert refused == [] and set(table.sources.values()) == {"reference"}


def _refused_once(reg, op: str) -> str:
    table, refused = resolve(reg)
    assert len(refused) == 1, refused
    assert table.sources[op] == "reference" and table.resolution[op].refused
    other = "swiglu" if op == "rmsnorm" else "rmsnorm"
    assert table.sources[other].startswith("torch_v1")  # the other op is unaffected
    return refused[0]


def test_tampered_variant_is_refused(reg):
    lock_both(reg)
    path = reg.variant_path("rmsnorm", "torch_v1")
    path.write_text(path.read_text().replace("xf * r", "xf * r * 1.0001"))
    msg = _refused_once(reg, "rmsnorm")
    assert "rmsnorm/torch_v1" in msg and "changed since it was locked" in msg


def test_missing_variant_file_is_refused(reg):
    lock_both(reg)
    reg.variant_path("swiglu", "torch_v1").unlink()
    assert "missing" in _refused_once(reg, "swiglu")


def test_wrong_arch_is_refused(reg):
    path = reg.variant_path("rmsnorm", "torch_v1")
    path.write_text(TORCH_RMSNORM + '\nARCHS = ("sm_90",)\n')
    lock_both(reg)
    assert "ARCHS" in _refused_once(reg, "rmsnorm")


def test_wrong_arch_in_record_is_refused_before_import(reg):
    path = reg.variant_path("swiglu", "torch_v1")
    path.write_text(TORCH_SWIGLU + "\nraise RuntimeError('must not be imported')\n")
    reg.write_record("swiglu", "torch_v1", new_record("swiglu", "torch_v1", sha256(path),
                                                      agent="x", archs=["sm_100"]))
    lock_both(reg)
    msg = _refused_once(reg, "swiglu")
    assert "recorded for arch sm_100" in msg and "must not be imported" not in msg


def test_import_error_is_refused(reg):
    path = reg.variant_path("swiglu", "torch_v1")
    path.write_text("import definitely_not_a_module_xyz\n" + TORCH_SWIGLU)
    lock_both(reg)
    assert "ModuleNotFoundError" in _refused_once(reg, "swiglu")


def test_exit_at_import_is_refused(reg):
    path = reg.variant_path("swiglu", "torch_v1")
    path.write_text("raise SystemExit(3)\n" + TORCH_SWIGLU)
    lock_both(reg)
    assert "SystemExit" in _refused_once(reg, "swiglu")


def test_malformed_lock_entry_and_unknown_op(reg):
    reg.lock_path.parent.mkdir(parents=True, exist_ok=True)
    reg.lock_path.write_text('[cpu]\nrmsnorm = { variant = "torch_v1" }\nnot_an_op = '
                             '{ variant = "x", sha256 = "' + "0" * 64 + '" }\n')
    table, refused = resolve(reg)
    assert len(refused) == 2 and set(table.sources.values()) == {"reference"}


def test_broken_lock_file_warns_and_runs_reference(reg):
    reg.lock_path.parent.mkdir(parents=True, exist_ok=True)
    reg.lock_path.write_text("[cpu\nthis is not toml")
    table, refused = resolve(reg)
    assert len(refused) == 1 and "TOML" in refused[0]
    assert set(table.sources.values()) == {"reference"}


def test_lock_path_argument(reg, tmp_path):
    lock_both(reg)
    other = tmp_path / "other.lock.toml"
    shutil.copy(reg.lock_path, other)
    reg.lock_path.unlink()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        table = resolve_ops(other, reg.root, device="cpu")
    assert refusals(record) == [] and table.sources["swiglu"].startswith("torch_v1")
    with pytest.raises(RegistryError, match="no such lock file"):
        resolve_ops(tmp_path / "nope.toml", reg.root)


def test_current_arch_on_cpu():
    assert current_arch("cpu") == "cpu"


# ---- tuned configs -----------------------------------------------------------------------------
def test_config_buckets_nearest_wins(reg):
    reg.write_configs("rmsnorm", "torch_v1", {"cpu": {"T=1": {"BLOCK": 1}, "T=8": {"BLOCK": 8},
                                                      "T=128": {"BLOCK": 128}}})
    lock_both(reg)
    table, _ = resolve(reg)
    call = table.impl("rmsnorm")
    assert isinstance(call, KernelCall)
    assert [call.config_for(t)["BLOCK"] for t in (1, 2, 3, 7, 30, 33, 5000)] == \
        [1, 1, 8, 8, 8, 128, 128]
    x, w, eps = CONTRACTS["rmsnorm"].make_inputs({"T": 100, "H": 64}, 0)
    table.rmsnorm(x, w, eps)
    # Modules are keyed by content hash, so this is the module the table called.
    assert reg.load_variant("rmsnorm", "torch_v1").SEEN[-1] == {"BLOCK": 128}


def test_config_miss_logs_once_and_uses_default(reg, caplog):
    reg.write_configs("rmsnorm", "torch_v1", {"NVIDIA H200": {"T=1": {"BLOCK": 1}}})
    lock_both(reg)
    with caplog.at_level(logging.INFO, logger="model.registry"):
        table, _ = resolve(reg)
        resolve(reg)
    misses = [r for r in caplog.records if "no tuned config" in r.getMessage()]
    assert len(misses) == 1
    assert table.impl("rmsnorm").config_for(7) == {"BLOCK": 64}


def test_bad_bucket_names_are_refused(reg):
    with pytest.raises(RegistryError, match="T=8"):
        reg.write_configs("rmsnorm", "torch_v1", {"cpu": {"tokens8": {}}})
    path = reg.config_path("rmsnorm", "torch_v1")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(["not", "a", "map"]))
    with pytest.raises(RegistryError, match="GPU name"):
        reg.read_configs("rmsnorm", "torch_v1")


def test_token_bucket_of_the_tp_boundary_is_its_t_axis():
    # allreduce_norm_residual_norm's first argument is partials[R, T, H]: the bucket is T, not R.
    call = KernelCall("allreduce_norm_residual_norm", "v", lambda *a, config=None: config,
                      {"T=1": {"A": 1}, "T=128": {"A": 128}}, None, "test")
    assert call(torch.zeros(8, 128, 4)) == {"A": 128}  # R = 8 would pick T=1
    rms = KernelCall("rmsnorm", "v", lambda *a, config=None: config,
                     {"T=1": {"A": 1}, "T=128": {"A": 128}}, None, "test")
    assert rms(torch.zeros(8, 128)) == {"A": 1}
