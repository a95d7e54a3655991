"""Tuned configs keyed by (GPU, the target's per-rank dims, bucket); kernel languages; the
schema 1 -> 2 migration of the three old verification shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autoopt.targets import load_target
from model.ops import contract
from model.registry import (
    LANGUAGES,
    ConfigKey,
    ConfigTable,
    Registry,
    RegistryError,
    read_declarations,
    sha256,
    writers,
)
from model.registry.configs import call_axes, signature_dims
from model.registry.migrate import migrate

from .registry_support import passing, resolve, write_variant

SWIGLU_TRITONISH = '''
import torch


def run(gate, up, config=None):
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)
'''


def test_signature_dims_skip_expressions_and_scalars():
    assert signature_dims("f(x[T,H] bf16, w[(2*Hq+2*Hkv)*D, H] bf16, n: int)") == \
        (("T", "H"), ("(2*Hq+2*Hkv)*D", "H"), None)
    fixed, token = call_axes("moe_experts")
    assert {name for *_, name in fixed} == {"H", "E", "I", "k"} and token == (0, 0)
    fixed, token = call_axes("attention")  # pages, rows, table width vary per call, like T
    assert {name for *_, name in fixed} == {"Hq", "Hkv", "D", "page"}


def test_nearest_bucket_rule():
    t = ConfigTable.from_json({"G": {"H=8": {"T=1": {"a": 1}, "T=8": {"a": 8},
                                             "T=128": {"a": 128}}},
                               "*": {"*": {"T=4": {"a": -4}}}})
    h8 = (("H", 8),)
    assert [t.lookup("G", h8, n)["a"] for n in (0, 1, 2, 3, 7, 30, 33, 5000)] == \
        [1, 1, 1, 8, 8, 8, 128, 128]  # log2 distance; a tie goes to the smaller bucket
    # (GPU, dims), then (GPU, *), then (*, dims), then (*, *); nothing: None (DEFAULT_CONFIG).
    assert t.lookup("G", (("H", 16),), 1) == {"a": -4}
    assert t.lookup("other GPU", h8, 1) == {"a": -4}
    only_g = ConfigTable(tuple(e for e in t.entries if e.key.gpu == "G"))
    assert only_g.lookup("G", (("H", 16),), 1) is None and only_g.lookup("H", h8, 1) is None
    assert ConfigTable.from_json(t.to_json()) == t and t.sha256 == ConfigTable(t.entries).sha256
    for bad in ({"G": {"H=8": {"tokens8": {}}}}, {"G": {"H": {"T=1": {}}}}, {"G": []}):
        with pytest.raises(RegistryError):
            ConfigTable.from_json(bad)


def _shape(target: str, op: str, batch: int) -> dict:
    """A decode target's per-rank shape of `op` at `batch` (the contract's, at its TP layout)."""
    t = load_target(target)
    return dict(contract(op).shapes_for(t.config(), t.tokens(batch), t.shard))


def _rows(target: str, op: str, config: dict) -> list[dict]:
    return [{"shape": _shape(target, op, b), "config": {**config, "B": b}}
            for b in load_target(target).batch_sizes]


@pytest.mark.parametrize("op", ["swiglu", "allreduce_norm_residual_norm"])
def test_tp2_and_tp8_decode_on_one_gpu_keep_separate_configs(tmp_path, op):
    reg = Registry(tmp_path / "k")
    write_variant(reg, op, "v1", SWIGLU_TRITONISH if op == "swiglu" else
                  "def run(*a, config=None):\n    return config\n")
    writers.record(reg, op, "v1", [passing(reg, op, "v1", arch="sm_90")])
    gpu = "NVIDIA H200"
    for target, cfg in (("h200-tp8-decode", {"TP": 8}), ("h200-tp2-decode", {"TP": 2})):
        writers.tune(reg, op, "v1", ConfigTable.from_rows(op, gpu, _rows(target, op, cfg)),
                     {"target": target})
        writers.accept(reg, op, "v1", "sm_90")
    configs = reg.read_configs(op, "v1")
    dims = {e.key.dims for e in configs.entries}
    assert len(dims) == 2  # one group per layout: the later tuning did not overwrite the first
    for target, tp in (("h200-tp8-decode", 8), ("h200-tp2-decode", 2)):
        for b in load_target(target).batch_sizes:
            key = ConfigKey.for_shape(op, gpu, _shape(target, op, b))
            assert configs.lookup(gpu, key.dims, key.bucket) == {"TP": tp, "B": b}, (target, b)
    entry = reg.read_lock().section("sm_90")[op]
    assert entry.configs_sha256 == configs.sha256


def test_languages_are_a_name_registry_read_without_running_the_file():
    assert set(LANGUAGES) >= {"triton", "cute", "torch", "library"}
    assert LANGUAGES["cute"].unavailable("cpu") and LANGUAGES["triton"].runs_on_cpu
    src = 'raise SystemExit("never run")\nLANGUAGE = "cute"\nARCHS = ("sm_90", "sm_100")\n'
    d = read_declarations(src)
    assert (d.language, d.archs, d.runs_on_cpu) == ("cute", ("sm_90", "sm_100"), False)
    assert read_declarations("def run(x, config=None):\n    return x\n").language == "triton"
    lib = read_declarations('LANGUAGE = "library"\nLIBRARY = "flashinfer-python==0.7.0"\n')
    assert lib.library == "flashinfer-python==0.7.0" and not lib.runs_on_cpu
    for bad, why in (('LANGUAGE = "fortran"', "unknown kernel language"),
                     ('LANGUAGE = "library"', "needs LIBRARY"),
                     ('LIBRARY = "flashinfer-python"', "pin one version"),
                     ("LANGUAGE = 'tri' + 'ton'", "plain literal"),
                     ('ARCHS = ("sm9",)', "arch")):
        with pytest.raises(RegistryError, match=why):
            read_declarations(bad)


def test_the_repo_variants_declare_their_language():
    reg = Registry()
    for op in reg.ops():
        for name in reg.variants(op):
            variant, _ = reg.read_variant(op, name)
            assert variant == reg.read_record(op, name).variant, (op, name)


# ---- migration ----------------------------------------------------------------------------------
# Schema 1 reports named no sha256 of their own: the record's applies.
V1_REPORT = {"op": "swiglu", "source": "/somewhere/on/a/machine/swiglu/v.py", "device": "cuda",
             "verdict": "pass", "reasons": [], "checks": {"numerics": {"passed": True}},
             "seeds": [0, 1], "shapes": [{"T": 1, "I": 2560}], "config": None,
             "env": {"gpu": "NVIDIA H200"}}


def _v1_registry(root: Path) -> Registry:
    reg = Registry(root)
    records = {
        "by_arch": {"verification": {"sm_90": V1_REPORT, "cpu": {**V1_REPORT, "device": "cpu"}},
                    "status": "accepted"},
        "by_device": {"verification": {"device": "cuda:0", "reports": [V1_REPORT, {
            **V1_REPORT, "config": {"ROWS": 4}}]}, "status": "candidate"},
        "unverified": {"verification": {}, "status": "candidate"},
    }
    lock = ["[sm_90]"]
    for name, extra in records.items():
        path = write_variant(reg, "swiglu", name, SWIGLU_TRITONISH + f"\n# {name}\n")
        sha = sha256(path)
        rec = {"schema": 1, "op": "swiglu", "variant": name, "sha256": sha,
               "status_reason": "", "archs": None, "provenance": {"agent": "x"},
               "benchmarks": [{"shape": {"T": 1, "I": 2560}, "gpu": "NVIDIA H200",
                               "median_us": 2.0, "config": {"ROWS": 4}}],
               "meaningful_for_speed": True, **extra}
        for k, v in {reg.record_path("swiglu", name): rec, reg.config_path("swiglu", name): {
                "NVIDIA H200": {"T=1": {"ROWS": 4}}}}.items():
            k.parent.mkdir(parents=True, exist_ok=True)
            k.write_text(json.dumps(v))
        if name == "by_arch":  # schema 1 lock entries pinned the file only
            lock.append(f'swiglu = {{ variant = "{name}", sha256 = "{sha}" }}')
    reg.lock_path.write_text("\n".join(lock) + "\n")
    return reg


def test_migration_normalises_every_verification_shape_and_keeps_the_evidence(tmp_path):
    reg = _v1_registry(tmp_path / "k")
    with pytest.raises(RegistryError, match="migrate"):
        reg.read_record("swiglu", "by_arch")
    done = migrate(reg.root)
    assert any("lock [sm_90] swiglu" in line for line in done)
    by_arch = reg.read_record("swiglu", "by_arch")
    assert by_arch.verdicts() == {"cpu": "pass", "sm_90": "pass"}
    assert by_arch.verification["sm_90"][0].report["source"] == "swiglu/by_arch.py"
    assert by_arch.verification["sm_90"][0].report["seeds"] == (0, 1)
    by_device = reg.read_record("swiglu", "by_device")
    assert by_device.verdicts() == {"sm_90": "pass"} and len(by_device.verification["sm_90"]) == 2
    assert reg.read_record("swiglu", "unverified").verdicts() == {}
    # Accepted: configs stay in configs/, now with the dims of the rows timed there.
    cfg = reg.read_configs("swiglu", "by_arch")
    assert cfg.lookup("NVIDIA H200", (("I", 2560),), 1) == {"ROWS": 4}
    # A candidate's configs move into its record, for review.
    assert not reg.config_path("swiglu", "by_device").exists()
    assert reg.read_record("swiglu", "by_device").proposed_configs.entries
    # The lock pins the migrated configs, and the runtime accepts the result.
    entry = reg.read_lock().section("sm_90")["swiglu"]
    assert entry.configs_sha256 == cfg.sha256
    table, refused = resolve(reg, arch="sm_90")
    assert refused == [] and table.sources["swiglu"].startswith("by_arch")
    assert migrate(reg.root) == []  # idempotent
