"""`autoopt registry ...` / `autoopt review ...` on a tmp registry and on the committed kernels/.

Output is read as JSON where the test compares values, and rich is given a wide console
elsewhere (CI has no COLUMNS and no TTY).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autoopt.cli import app
from model.registry import Registry, resolve_ops, shipped_root, writers

from .registry_support import TORCH_SWIGLU, passing, write_variant

V2 = TORCH_SWIGLU.replace("F.silu(gate.float())", "gate.float() * gate.float().sigmoid()")
CORPUS = Path(__file__).resolve().parent / "adversarial"


@pytest.fixture
def reg(tmp_path):
    r = Registry(tmp_path / "kernels")
    write_variant(r, "swiglu", "torch_v1", TORCH_SWIGLU)
    write_variant(r, "swiglu", "torch_v2", V2)
    writers.record(r, "swiglu", "torch_v1", [passing(r, "swiglu", "torch_v1")],
                   [{"target": "h200-tp8-decode", "gpu": "NVIDIA H200", "shape": {"T": 1},
                     "median_us": 2.5, "iqr_us": 0.1, "x_reference": 1.8, "x_compile": 1.1,
                     "pct_of_floor": 40.0, "meaningful": True}])
    return r


def cli(*args: str):
    # rich reads COLUMNS at print time: wide enough that no cell wraps.
    return CliRunner().invoke(app, list(args), catch_exceptions=False, env={"COLUMNS": "240"})


def rows(*args: str) -> list[dict]:
    out = cli(*args, "--json")
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout)


def test_list_shows_status_and_flags_modified_files(reg):
    out = cli("registry", "list", "--registry", str(reg.root))
    assert out.exit_code == 0, out.output
    assert "torch_v1" in out.output and "candidate" in out.output and "1.80x" in out.output
    assert "unrecorded" in out.output and "cpu:pass" in out.output  # torch_v2 has no record
    path = reg.variant_path("swiglu", "torch_v1")
    path.write_text(path.read_text() + "# edit\n")
    out = cli("registry", "list", "--registry", str(reg.root))
    assert out.exit_code == 1 and "MODIFIED" in out.output and "immutable" in out.output


def test_show_and_json(reg):
    out = cli("registry", "show", "swiglu", "torch_v1", "--registry", str(reg.root))
    assert out.exit_code == 0, out.output
    for part in ("hand-written", "verified on cpu: pass", "h200-tp8-decode", "language torch",
                 "## Diff against reference"):
        assert part in out.output, part
    rec = json.loads(cli("registry", "show", "swiglu", "torch_v1", "--registry",
                         str(reg.root), "--json").stdout)
    assert rec["variant"]["sha256"] == Registry.sha256(reg.variant_path("swiglu", "torch_v1"))
    assert cli("registry", "show", "swiglu", "nope", "--registry", str(reg.root)).exit_code == 1


def test_diff(reg):
    out = cli("registry", "diff", "swiglu", "torch_v1", "torch_v2", "--registry", str(reg.root))
    assert out.exit_code == 0
    assert "-    return (F.silu" in out.output and "+    return (gate.float()" in out.output


def test_accept_lock_show_unset(reg):
    base = ("registry", "lock", "--registry", str(reg.root), "--arch", "cpu")
    out = cli(*base, "--op", "swiglu", "--variant", "torch_v1")
    assert out.exit_code == 1 and "not 'accepted'" in out.output
    out = cli("registry", "set-status", "swiglu", "torch_v1", "accepted", "--reason", "1.8x",
              "--registry", str(reg.root))
    assert out.exit_code == 0 and reg.read_lock().section("cpu") == {}  # accepted, not locked
    out = cli(*base, "--op", "swiglu", "--variant", "torch_v1")
    assert out.exit_code == 0 and "[cpu] swiglu = torch_v1" in out.output
    lock = rows("registry", "lock", "--registry", str(reg.root))
    assert [(r["arch"], r["op"], r["variant"], r["state"]) for r in lock] == \
        [("cpu", "swiglu", "torch_v1", "ok")]
    out = cli(*base, "--op", "swiglu", "--unset")
    assert out.exit_code == 0 and reg.read_lock().section("cpu") == {}


def test_missing_registry_and_lock_say_where_they_looked(tmp_path):
    out = cli("registry", "list", "--registry", str(tmp_path / "nothing"))
    assert out.exit_code == 1 and "no registry at" in out.output
    empty = tmp_path / "empty"
    (empty / "swiglu").mkdir(parents=True)
    out = cli("registry", "lock", "--registry", str(empty))
    assert out.exit_code == 1 and "no lock file: looked for" in out.output


def test_record_verifies_times_and_writes_the_record(tmp_path):
    reg = Registry(tmp_path / "k")
    reg.variant_path("swiglu", "plain").parent.mkdir(parents=True)
    shutil.copy(CORPUS / "honest_torch_swiglu.py", reg.variant_path("swiglu", "plain"))
    out = cli("registry", "record", "swiglu", "plain", "--registry", str(reg.root), "--device",
              "cpu", "--seeds", "0", "--tokens", "1,17", "--no-compile", "--warmup", "1",
              "--iters", "2")
    assert out.exit_code == 0, out.output
    rec = reg.read_record("swiglu", "plain")
    assert rec.status == "candidate" and rec.verdicts() == {"cpu": "pass"}
    assert rec.verification["cpu"][0].report["source"] == "swiglu/plain.py"
    assert [b.shape["T"] for b in rec.benchmarks] == [1, 17]
    assert all(b.get("target") == "cpu-tiny" and not b.meaningful for b in rec.benchmarks)


def test_tune_verifies_times_and_proposes_configs_per_bucket(tmp_path):
    reg = Registry(tmp_path / "k")
    reg.variant_path("swiglu", "tri").parent.mkdir(parents=True)
    shutil.copy(CORPUS / "honest_triton_swiglu.py", reg.variant_path("swiglu", "tri"))
    base = ("--registry", str(reg.root), "--device", "cpu", "--seeds", "0")
    out = cli("registry", "tune", "swiglu", "tri", *base, "--configs", '{"T=1": {}}')
    assert out.exit_code == 2 and "has no record" in out.output, out.output
    out = cli("registry", "record", "swiglu", "tri", *base, "--tokens", "1", "--no-bench")
    assert out.exit_code == 0, out.output
    for bad, why in (("{}", "no configs"), ("[1]", "JSON object"), ('{"T=1": 5}', "JSON object"),
                     ('{"X=1": {}}', "X=1"), ("not json", "Expecting value")):
        out = cli("registry", "tune", "swiglu", "tri", *base, "--configs", bad)
        assert out.exit_code == 2 and why in out.output, (bad, out.output)
    sweep = tmp_path / "results.json"
    sweep.write_text('{"best": {"T=1": {"BLOCK": 256}}}')
    out = cli("registry", "tune", "swiglu", "tri", *base, "--warmup", "1", "--iters", "2",
              "--configs", '{"T=1": {"BLOCK": 256}, "T=17": {"BLOCK": 4096}}',
              "--source", str(sweep))
    assert out.exit_code == 0, out.output
    assert "speed not judged" in out.output and "CONFIG_SPACE" not in out.output
    rec = reg.read_record("swiglu", "tri")
    assert rec.status == "candidate" and rec.verdicts() == {"cpu": "pass"}  # record untouched
    proposed = rec.proposed_configs.to_json()["cpu"]
    assert [c for by_bucket in proposed.values() for c in by_bucket.values()] == [
        {"BLOCK": 256}, {"BLOCK": 4096}], proposed
    (tuning,) = rec.tunings
    assert tuning["verification"][0]["verdict"] == "pass" and "BLOCK" in tuning["source"]
    assert [(r["label"], r["shape"]["T"]) for r in tuning["benchmarks"]] == [
        ("default", 1), ("tuned", 1), ("default", 17), ("tuned", 17)]


def test_tune_says_which_values_lie_beyond_the_declared_space(tmp_path):
    # A hand sweep may go past CONFIG_SPACE (the judge verifies what it is given); the proposal
    # names those values for the reviewer.
    reg = Registry(tmp_path / "k")
    reg.variant_path("swiglu", "tri").parent.mkdir(parents=True)
    shutil.copy(CORPUS / "honest_triton_swiglu.py", reg.variant_path("swiglu", "tri"))
    base = ("--registry", str(reg.root), "--device", "cpu", "--seeds", "0")
    assert cli("registry", "record", "swiglu", "tri", *base, "--tokens", "1",
               "--no-bench").exit_code == 0
    out = cli("registry", "tune", "swiglu", "tri", *base, "--warmup", "1", "--iters", "2",
              "--configs", '{"T=1": {"BLOCK": 512}}')
    assert out.exit_code == 0, out.output
    assert "beyond the file's CONFIG_SPACE (verified as given): T=1 BLOCK=512" in out.output
    (tuning,) = reg.read_record("swiglu", "tri").tunings
    assert list(tuning["outside_config_space"]) == ["T=1 BLOCK=512"]


def test_tune_judges_speed_only_where_a_bucket_has_a_config(tmp_path, monkeypatch):
    # Timings that count (as on a GPU): a tuned config slower than the default is not proposed
    # (nothing is written when no config is left), but a null bucket (the file's defaults, bounding the configs below it) runs the same
    # config twice, so its order is noise and is not held against the proposal.
    import autoopt.eval as ev
    from autoopt.registry_record import TuneArgs, tune_variant

    reg = Registry(tmp_path / "k")
    reg.variant_path("swiglu", "tri").parent.mkdir(parents=True)
    shutil.copy(CORPUS / "honest_triton_swiglu.py", reg.variant_path("swiglu", "tri"))
    base = ("--registry", str(reg.root), "--device", "cpu", "--seeds", "0")
    assert cli("registry", "record", "swiglu", "tri", *base, "--tokens", "1",
               "--no-bench").exit_code == 0
    speed: dict[int, list[float]] = {}  # per T: the default's time, then the tuned one's

    class Row:
        def __init__(self, shape):
            self.d = {"shape": dict(shape), "median_us": speed[shape["T"]].pop(0),
                      "meaningful": True, "gpu": "cpu"}

        def to_dict(self):
            return dict(self.d)

    monkeypatch.setattr(ev, "verify_variant", lambda *a, **k: type(
        "R", (), {"to_dict": lambda self: {"verdict": "pass", "reasons": []}})())
    monkeypatch.setattr(ev, "bench_op", lambda op, path, shapes, device, **k: [Row(shapes[0])])
    args = TuneArgs("swiglu", "tri", {"T=1": {"BLOCK": 256}, "T=4": None}, "cpu", 0)
    # The null bucket's second timing of the same config comes out slower: not a verdict.
    speed.update({1: [10.0, 8.0], 4: [4.9, 5.0]})
    rec, _, rows, what = tune_variant(reg, args)
    assert rec is not None and "proposed" in what, what
    assert [r["median_us"] for r in rows] == [10.0, 8.0, 4.9, 5.0]
    speed.update({1: [10.0, 11.0], 4: [5.0, 5.0]})  # the only config slower: nothing written
    rec, _, _, what = tune_variant(reg, args)
    assert rec is None and "T=1: 11.00 us tuned against 10.00" in what, what
    assert "nothing written" in what
    # Two configs, one slower: that bucket is proposed as the defaults, the other stands.
    args = TuneArgs("swiglu", "tri", {"T=1": {"BLOCK": 256}, "T=8": {"BLOCK": 512}}, "cpu", 0)
    speed.update({1: [10.0, 10.1], 8: [20.0, 15.0]})
    rec, _, rows, what = tune_variant(reg, args)
    assert rec is not None and "kept at the defaults, slower tuned (T=1: 10.10 us" in what, what
    proposed = {e.key.bucket: e.config for e in rec.proposed_configs.entries}
    assert proposed == {1: {}, 8: {"BLOCK": 512}}
    assert list(rec.tunings[-1]["kept_defaults"]) == ["T=1: 10.10 us tuned against 10.00"]
    assert [r["config"] for r in rows] == [{}, {"BLOCK": 256}, {}, {"BLOCK": 512}]


def test_tune_writes_nothing_when_the_judge_rejects_the_configs(tmp_path):
    reg = Registry(tmp_path / "k")
    reg.variant_path("swiglu", "tri").parent.mkdir(parents=True)
    shutil.copy(CORPUS / "honest_triton_swiglu.py", reg.variant_path("swiglu", "tri"))
    base = ("--registry", str(reg.root), "--device", "cpu", "--seeds", "0")
    assert cli("registry", "record", "swiglu", "tri", *base, "--tokens", "1",
               "--no-bench").exit_code == 0
    before = reg.record_path("swiglu", "tri").read_bytes()
    out = cli("registry", "tune", "swiglu", "tri", *base, "--configs", '{"T=1": {"BLOCK": 3}}')
    assert out.exit_code == 1 and "nothing written" in out.output, out.output
    assert reg.record_path("swiglu", "tri").read_bytes() == before


def test_migrate_command_is_idempotent_on_a_current_registry(reg):
    out = cli("registry", "migrate", "--registry", str(reg.root))
    assert out.exit_code == 0 and "already schema 2" in out.output


# ---- the committed registry ----------------------------------------------------------------
def test_list_show_review_and_the_loader_agree_on_the_committed_registry():
    root = str(shipped_root())
    listed = {(r["op"], r["variant"]): r for r in rows("registry", "list", "--registry", root)}
    accepted = {(r["op"], r["variant"]): r
                for r in rows("review", "list", "--status", "accepted", "--registry", root)}
    assert listed and all(r["file"] == "ok" for r in listed.values())
    assert accepted == {k: r for k, r in listed.items() if r["status"] == "accepted"}
    for (op, name), r in listed.items():
        rec = json.loads(cli("registry", "show", op, name, "--registry", root, "--json").stdout)
        assert rec["status"] == r["status"], (op, name)
        verdicts = " ".join(f"{a}:pass" for a in sorted(rec["verification"]))
        if rec["status"] == "rejected" or (rec["status"] == "candidate"
                                          and not rec["variant"]["runs_on_cpu"]):
            # A rejected variant, and a GPU-only candidate (a library's), show their verdicts as
            # recorded, a reject with its reasons included; neither is accepted or loaded
            # without a pass.
            verdicts = " ".join(f"{a}:{rec['verification'][a][-1]['verdict']}"
                                for a in sorted(rec["verification"])) or "unverified"
        assert r["verified"] == verdicts, (op, name)  # every other committed variant verified
    lock = rows("registry", "lock", "--registry", root)
    assert lock and all(r["state"] == "ok" for r in lock)
    for arch in {r["arch"] for r in lock}:
        table = resolve_ops("tuned", root, arch=arch, device="cpu")
        loaded = {op: res.variant for op, res in table.resolution.items()
                  if res.source != "reference"}
        assert loaded == {r["op"]: r["variant"] for r in lock if r["arch"] == arch}
        for op, name in loaded.items():
            assert arch in listed[(op, name)]["locked"].split()
            assert f"{arch}:pass" in listed[(op, name)]["verified"]
