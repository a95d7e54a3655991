"""`autoopt verify` and `autoopt bench`: exit codes, JSON, registry resolution, tables."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autoopt.cli import app

CORPUS = Path(__file__).resolve().parent / "adversarial"
WIDE = {"COLUMNS": "200"}


@pytest.fixture()
def registry(tmp_path: Path) -> Path:
    root = tmp_path / "reg"
    (root / "swiglu").mkdir(parents=True)
    shutil.copy(CORPUS / "honest_torch_swiglu.py", root / "swiglu" / "plain.py")
    shutil.copy(CORPUS / "near_miss_two_step.py", root / "swiglu" / "two_step.py")
    return root


def _run(args: list[str]):
    return CliRunner().invoke(app, args, env=WIDE)


def test_verify_pass_exits_0_with_json(registry):
    res = _run(["verify", "--op", "swiglu", "--variant", "plain", "--registry", str(registry),
                "--device", "cpu", "--tokens", "1,17", "--seeds", "0", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["verdict"] == "pass" and report["reasons"] == []
    assert report["source"].endswith("swiglu/plain.py")


def test_verify_reject_exits_1_and_names_the_reason(registry):
    res = _run(["verify", "--op", "swiglu", "--variant", "two_step", "--registry", str(registry),
                "--device", "cpu", "--tokens", "17", "--seeds", "0"])
    assert res.exit_code == 1, res.output
    assert "reject" in res.output and "closer to near miss 'bf16_two_step'" in res.output


def test_verify_source_outside_a_registry_static_reject():
    res = _run(["verify", "--op", "swiglu", "--source", str(CORPUS / "network.py"), "--json"])
    assert res.exit_code == 1
    report = json.loads(res.stdout)
    assert report["verdict"] == "reject"
    assert report["reasons"] == ["static screen: imports urllib (network)"]


def test_verify_missing_variant_says_what_exists(registry):
    res = _run(["verify", "--op", "swiglu", "--variant", "nope", "--registry", str(registry)])
    assert res.exit_code == 2
    assert "no variant 'nope'" in res.output and "plain" in res.output


def test_bench_prints_the_table(registry):
    res = _run(["bench", "--op", "swiglu", "--variant", "plain", "--registry", str(registry),
                "--device", "cpu", "--tokens", "1,17", "--iters", "3", "--warmup", "1",
                "--no-compile"])
    assert res.exit_code == 0, res.output
    for col in ("median µs", "IQR µs", "x reference", "x torch.compile", "% of floor"):
        assert col in res.output
    assert "T=17,I=320" in res.output and "not meaningful for speed" in res.output


def test_bench_target_shapes_as_json():
    res = _run(["bench", "--op", "swiglu", "--target", "cpu-tiny", "--device", "cpu",
                "--iters", "3", "--warmup", "1", "--no-compile", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    from autoopt.targets import load_target

    target = load_target("cpu-tiny")
    assert [r["shape"] for r in rows] == [target.op_shapes(b)["swiglu"]
                                         for b in target.batch_sizes]
    assert all(r["impl"] == "reference" and r["meaningful"] is False for r in rows)


def test_verify_secret_reproduces_the_plan(registry):
    args = ["verify", "--op", "swiglu", "--variant", "plain", "--registry", str(registry),
            "--device", "cpu", "--seeds", "0", "--json"]
    first = json.loads(_run(args).stdout)
    again = json.loads(_run([*args, "--secret", first["secret"]]).stdout)
    other = json.loads(_run(args).stdout)
    assert again["checks"]["plan"] == first["checks"]["plan"] and again["seeds"] == first["seeds"]
    assert other["secret"] != first["secret"] and other["seeds"] != first["seeds"]


def test_verify_bad_secret_is_a_clear_error(registry):
    res = _run(["verify", "--op", "swiglu", "--variant", "plain", "--registry", str(registry),
                "--device", "cpu", "--secret", "xyz"])
    assert res.exit_code == 2 and "--secret must be the hex string" in res.output
