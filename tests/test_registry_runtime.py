"""The runtime loads a locked variant only on evidence; every refusal warns once and falls back.

Each test starts from a registry whose two plain-torch variants are recorded, verified on the
CPU, accepted and locked (tests/registry_support.py), then breaks one link of the evidence.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from model.ops import CONTRACTS
from model.registry import (
    ConfigTable,
    KernelCall,
    Lock,
    LockEntry,
    Registry,
    RegistryError,
    resolve_ops,
    sha256,
    writers,
)

from .registry_support import TORCH_SWIGLU, passing, resolve, torch_registry, write_variant


@pytest.fixture
def reg(tmp_path) -> Registry:
    return torch_registry(tmp_path / "kernels")


def _refused_once(reg: Registry, op: str, **kw) -> str:
    table, refused = resolve(reg, **kw)
    assert len(refused) == 1, refused
    assert table.sources[op] == "reference" and table.resolution[op].refused
    other = "swiglu" if op == "rmsnorm" else "rmsnorm"
    assert table.sources[other].startswith("torch_v1")  # the other op is unaffected
    return refused[0]


def _lock_by_hand(reg: Registry, op: str, name: str) -> None:
    """What a person editing registry.lock.toml does: pin a file's hash, no writer involved."""
    lock = reg.read_lock()
    configs = ConfigTable().sha256
    entry = LockEntry(name, sha256(reg.variant_path(op, name)), configs)
    reg.lock_path.write_text(lock.with_entry("cpu", op, entry).to_toml())


def test_locked_variants_run(reg):
    table, refused = resolve(reg)
    assert refused == [] and table.sources["rmsnorm"].startswith("torch_v1 (")
    assert table.sources["attention"] == "reference"
    x, w, eps = CONTRACTS["rmsnorm"].make_inputs({"T": 5, "H": 64}, 0)
    assert torch.equal(table.rmsnorm(x, w, eps), CONTRACTS["rmsnorm"].reference(x, w, eps))


def test_reference_ignores_the_lock_and_a_missing_arch_runs_the_reference(reg):
    assert set(resolve_ops("reference", reg.root).sources.values()) == {"reference"}
    table, refused = resolve(reg, arch="sm_90")
    assert refused == [] and set(table.sources.values()) == {"reference"}


def test_a_lock_edited_to_an_unrecorded_variant_is_refused(reg):
    write_variant(reg, "swiglu", "sneaky_v1", TORCH_SWIGLU + "\n# never verified\n")
    _lock_by_hand(reg, "swiglu", "sneaky_v1")
    assert "no record" in _refused_once(reg, "swiglu")


def test_a_lock_edited_to_a_candidate_or_rejected_variant_is_refused(reg):
    write_variant(reg, "swiglu", "cand_v1", TORCH_SWIGLU + "\n# candidate\n")
    writers.record(reg, "swiglu", "cand_v1", [passing(reg, "swiglu", "cand_v1")])
    _lock_by_hand(reg, "swiglu", "cand_v1")
    assert "'candidate', not accepted" in _refused_once(reg, "swiglu")
    # The optimize loop's trial of a run's new set may load verified candidates; serving not.
    table, refused = resolve(reg, allow_candidates=True)
    assert refused == [] and table.sources["swiglu"].startswith("cand_v1")
    writers.reject(reg, "swiglu", "cand_v1", "no")
    _lock_by_hand(reg, "swiglu", "cand_v1")
    assert "'rejected'" in _refused_once(reg, "swiglu", allow_candidates=True)


def test_verified_on_another_arch_only_is_refused_before_import(reg):
    write_variant(reg, "swiglu", "gpu_v1", TORCH_SWIGLU + "\nraise RuntimeError('imported')\n")
    writers.record(reg, "swiglu", "gpu_v1", [passing(reg, "swiglu", "gpu_v1", arch="sm_90")])
    writers.accept(reg, "swiglu", "gpu_v1", "sm_90")
    _lock_by_hand(reg, "swiglu", "gpu_v1")
    msg = _refused_once(reg, "swiglu")
    assert "no passing verification of these bytes on cpu" in msg and "imported" not in msg


def test_a_failed_verification_is_refused(reg):
    sha = sha256(reg.variant_path("swiglu", "torch_v1"))
    writers.record(reg, "swiglu", "torch_v1", [writers.Verification("cpu", "reject", sha)])
    assert "verdict there: reject" in _refused_once(reg, "swiglu")


def test_a_tampered_or_missing_file_is_refused(reg, tmp_path):
    path = reg.variant_path("rmsnorm", "torch_v1")
    path.write_text(path.read_text().replace("xf * r", "xf * r * 1.0001"))
    assert "changed since it was locked" in _refused_once(reg, "rmsnorm")
    reg2 = torch_registry(tmp_path / "k2")
    reg2.variant_path("swiglu", "torch_v1").unlink()
    assert "does not exist" in _refused_once(reg2, "swiglu")


def test_a_symlinked_variant_is_refused(reg, tmp_path):
    # Same bytes, so every hash matches: only the link itself gives it away.
    path = reg.variant_path("swiglu", "torch_v1")
    outside = tmp_path / "outside.py"
    shutil.copy(path, outside)
    path.unlink()
    path.symlink_to(outside)
    assert "symlink" in _refused_once(reg, "swiglu")


def test_a_symlinked_op_directory_is_refused(reg, tmp_path):
    op_dir = reg.root / "swiglu"
    moved = tmp_path / "elsewhere"
    shutil.move(op_dir, moved)
    op_dir.symlink_to(moved, target_is_directory=True)
    assert "symlink" in _refused_once(reg, "swiglu")


def test_a_config_changed_after_locking_is_refused(reg):
    table = ConfigTable.from_rows("rmsnorm", "cpu", [{"shape": {"T": 4, "H": 64},
                                                      "config": {"BLOCK": 32}}])
    writers.tune(reg, "rmsnorm", "torch_v1", table, {"run": "r"})
    writers.accept(reg, "rmsnorm", "torch_v1", "cpu")
    assert resolve(reg)[1] == []
    path = reg.config_path("rmsnorm", "torch_v1")
    data = json.loads(path.read_text())
    data["configs"]["cpu"]["H=64"]["T=4"]["BLOCK"] = 1024
    path.write_text(json.dumps(data))
    assert "configs changed since it was locked" in _refused_once(reg, "rmsnorm")
    path.unlink()  # deleting them is a change too
    assert "configs changed since it was locked" in _refused_once(reg, "rmsnorm")


def test_declared_archs_language_and_library_are_respected(tmp_path):
    cases = {"ARCHS = ('sm_90',)": "ARCHS", 'LANGUAGE = "cute"': "NVIDIA GPUs only",
             'LANGUAGE = "library"\nLIBRARY = "surely-not-installed-xyz==1.0"': "GPUs only",
             'LIBRARY = "surely-not-installed-xyz==1.0"': "not installed"}
    for i, (decl, why) in enumerate(cases.items()):
        reg = torch_registry(tmp_path / f"k{i}")
        src = TORCH_SWIGLU.replace('LANGUAGE = "torch"', decl)
        write_variant(reg, "swiglu", "decl_v1", src)
        writers.record(reg, "swiglu", "decl_v1", [passing(reg, "swiglu", "decl_v1")])
        writers.set_status(reg, "swiglu", "decl_v1", "accepted")
        _lock_by_hand(reg, "swiglu", "decl_v1")
        assert why in _refused_once(reg, "swiglu"), decl


@pytest.mark.parametrize("prefix,why", [("import definitely_not_a_module_xyz\n",
                                         "ModuleNotFoundError"),
                                        ("raise SystemExit(3)\n", "SystemExit")])
def test_an_import_failure_is_refused(tmp_path, prefix, why):
    reg = torch_registry(tmp_path / "k")
    write_variant(reg, "swiglu", "bad_v1", prefix + TORCH_SWIGLU)
    writers.record(reg, "swiglu", "bad_v1", [passing(reg, "swiglu", "bad_v1")])
    writers.accept(reg, "swiglu", "bad_v1", "cpu")
    assert why in _refused_once(reg, "swiglu")


def test_malformed_lock_entries_and_unknown_ops_warn(reg):
    reg.lock_path.write_text('[cpu]\nrmsnorm = { variant = "torch_v1" }\nnot_an_op = '
                             '{ variant = "x", sha256 = "' + "0" * 64 + '", configs_sha256 = "'
                             + "0" * 64 + '" }\n')
    table, refused = resolve(reg)
    assert len(refused) == 2 and set(table.sources.values()) == {"reference"}
    reg.lock_path.write_text("[cpu\nthis is not toml")
    table, refused = resolve(reg)
    assert len(refused) == 1 and "TOML" in refused[0]


def test_a_lock_file_by_path_and_a_missing_one(reg, tmp_path):
    other = tmp_path / "other.lock.toml"
    shutil.copy(reg.lock_path, other)
    reg.lock_path.unlink()
    table, refused = resolve(reg, kernels=other)
    assert refused == [] and table.sources["swiglu"].startswith("torch_v1")
    with pytest.raises(RegistryError, match="no such lock file"):
        resolve_ops(tmp_path / "nope.toml", reg.root)
    with pytest.raises(RegistryError, match="no registry at"):
        resolve_ops("tuned", tmp_path / "no-registry-here")



def test_a_registry_copy_taken_before_a_change_is_that_changes_before(reg, tmp_path):
    # Tune and accept change the configs a lock pins; a copy of the registry taken first is the
    # "before" of one side-by-side run: its own registry.lock.toml, given by path, reads its own
    # configs and records, whatever the registry the other sets come from.
    before = tmp_path / "before"
    shutil.copytree(reg.root, before)
    table = ConfigTable.from_rows("rmsnorm", "cpu", [{"shape": {"T": 4, "H": 64},
                                                      "config": {"BLOCK": 32}}])
    writers.tune(reg, "rmsnorm", "torch_v1", table, {"run": "r"})
    writers.accept(reg, "rmsnorm", "torch_v1", "cpu")
    after, refused = resolve(reg)
    assert refused == [] and after.sources["rmsnorm"].startswith("torch_v1")
    old, refused = resolve(reg, kernels=before / "registry.lock.toml")
    assert refused == [] and old.sources["rmsnorm"].startswith("torch_v1")
    assert old.resolution["rmsnorm"].refused is None
    # The same lock under another name, or alone in a folder without op folders, reads the
    # registry given: the new configs, refused.
    (tmp_path / "lone").mkdir()
    for other in (tmp_path / "before.lock.toml", tmp_path / "lone" / "registry.lock.toml"):
        shutil.copy(before / "registry.lock.toml", other)
        assert "configs changed since it was locked" in _refused_once(reg, "rmsnorm", kernels=other)
def test_fp32_models_run_the_references(reg):
    table, refused = resolve(reg, dtype=torch.float32)
    assert refused == [] and set(table.sources.values()) == {"reference"}
    assert "BF16 contracts" in table.resolution["rmsnorm"].refused


def test_configs_by_bucket_and_by_the_calls_own_dims(reg):
    rows = [{"shape": {"T": t, "H": 64}, "config": {"BLOCK": t}} for t in (1, 8, 128)]
    rows.append({"shape": {"T": 8, "H": 96}, "config": {"BLOCK": 96}})
    writers.tune(reg, "rmsnorm", "torch_v1", ConfigTable.from_rows("rmsnorm", "cpu", rows), {})
    writers.accept(reg, "rmsnorm", "torch_v1", "cpu")
    table, refused = resolve(reg)
    call = table.impl("rmsnorm")
    assert refused == [] and isinstance(call, KernelCall)
    h64 = (("H", 64),)
    assert [call.config_for(t, h64)["BLOCK"] for t in (1, 2, 3, 7, 30, 33, 5000)] == \
        [1, 1, 8, 8, 8, 128, 128]
    assert call.config_for(1, (("H", 96),)) == {"BLOCK": 96}
    assert call.config_for(1, (("H", 32),)) == {"BLOCK": 64}  # no entry: DEFAULT_CONFIG
    module = reg.load_variant("rmsnorm", "torch_v1")  # one module per content hash
    for shape, want in (({"T": 100, "H": 64}, 128), ({"T": 3, "H": 96}, 96)):
        x, w, eps = CONTRACTS["rmsnorm"].make_inputs(shape, 0)
        table.rmsnorm(x, w, eps)
        assert module.SEEN[-1] == {"BLOCK": want}


def test_a_config_miss_logs_once(reg, caplog):
    rows = [{"shape": {"T": 1, "H": 64}, "config": {"BLOCK": 1}}]
    writers.tune(reg, "rmsnorm", "torch_v1", ConfigTable.from_rows("rmsnorm", "NVIDIA H200",
                                                                   rows), {})
    writers.accept(reg, "rmsnorm", "torch_v1", "cpu")
    with caplog.at_level(logging.INFO, logger="model.registry"):
        call = resolve(reg)[0].impl("rmsnorm")
        assert call.config_for(7, (("H", 64),)) == {"BLOCK": 64}
        call.config_for(9, (("H", 64),))
    assert len([r for r in caplog.records if "no tuned config" in r.getMessage()]) == 1


def test_the_tp_boundary_reads_its_bucket_from_t_and_its_dims_from_r_and_h():
    rows = [{"shape": {"R": r, "T": t, "H": 4}, "config": {"A": r * 1000 + t}}
            for r in (2, 8) for t in (1, 128)]
    configs = ConfigTable.from_rows("allreduce_norm_residual_norm", "g", rows)
    call = KernelCall("allreduce_norm_residual_norm", "v", lambda *a, config=None: config,
                      configs, "g", None, "test")
    assert call(torch.zeros(8, 128, 4)) == {"A": 8128}  # R = 8 ranks, T = 128 (not R)
    assert call(torch.zeros(2, 1, 4)) == {"A": 2001}
    assert call.key_of((torch.zeros(8, 3, 4),)) == (3, (("H", 4), ("R", 8)))


def test_committed_lock_loads_every_sm90_entry():
    # The repository's lock, resolved as an sm_90 machine would (its Triton files import here;
    # nothing runs): every entry passes its evidence checks.
    table, refused = resolve(Registry(), arch="sm_90")
    assert refused == []
    locked = Lock.read(Registry().lock_path).section("sm_90")
    assert {op for op, s in table.sources.items() if s != "reference"} == set(locked)


@pytest.mark.gpu
def test_committed_lock_runs_on_the_gpu_with_its_tuned_config():
    # On an sm_90 GPU the repository's lock loads every entry, and norm_residual_norm gets the
    # config tuned for its TP8 per-rank width (H=5120) at T=1 on an H200.
    import warnings

    from model.registry import KernelRefusedWarning, current_arch, gpu_name

    with warnings.catch_warnings():
        warnings.simplefilter("error", KernelRefusedWarning)
        table = resolve_ops("tuned", device="cuda")
    arch = current_arch("cuda")
    locked = Lock.read(Registry().lock_path).section(arch)
    assert {op for op, s in table.sources.items() if s != "reference"} == set(locked)
    if "norm_residual_norm" not in locked:
        return
    c = CONTRACTS["norm_residual_norm"]
    args = c.make_inputs({"T": 1, "H": 5120}, 0, "cuda")
    call = table.impl("norm_residual_norm")
    tuned = Registry().read_configs("norm_residual_norm", locked["norm_residual_norm"].variant)
    want = tuned.lookup(gpu_name("cuda"), (("H", 5120),), 1)
    assert call.key_of(args) == (1, (("H", 5120),))
    assert call.config_for(*call.key_of(args)) == (dict(want) if want is not None
                                                   else call.default)
    for got, ref in zip(table.norm_residual_norm(*args), c.reference(*args)):
        assert torch.equal(got, ref)


def test_plus_compile_keeps_the_lock_and_compiles_what_it_leaves(tmp_path):
    # `--kernels tuned+compile`: the server's lock as it is, Inductor for the ops the lock leaves
    # at the reference, the host-syncing MoE reference and composites as they were.
    from model.ops.compiled import SOURCE
    from tests.registry_support import torch_registry

    reg = torch_registry(tmp_path / "reg", ops=("rmsnorm",))
    table = resolve_ops("tuned+compile", reg.root, arch="cpu", device="cpu")
    assert table.sources["rmsnorm"].startswith("torch_v1")
    assert table.sources["router"] == table.sources["swiglu"] == SOURCE
    assert table.sources["moe_experts"] == "reference"
    assert table.sources["gated_o_proj"] == "reference"  # composed from its (compiled) parts
    assert table.resolution["rmsnorm"].variant == "torch_v1"
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    w = torch.rand(64, dtype=torch.bfloat16) + 0.5
    from model.ops import contract

    want = contract("rmsnorm").reference(x, w, 1e-6)
    assert torch.equal(table.rmsnorm(x, w, 1e-6), want)
    plain = resolve_ops("tuned", reg.root, arch="cpu", device="cpu")
    assert plain.sources["router"] == "reference"
