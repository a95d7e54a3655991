"""`autoopt registry list|show|diff|lock|set-status` on a tmp registry."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from autoopt.cli import app
from model.registry import Registry, new_record, sha256

V1 = "import torch\n\n\ndef run(gate, up, config=None):\n    return gate * up\n"
V2 = V1.replace("gate * up", "up * gate")


@pytest.fixture
def reg(tmp_path):
    r = Registry(tmp_path / "kernels")
    for name, src in (("torch_v1", V1), ("torch_v2", V2)):
        path = r.variant_path("swiglu", name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(src)
    rec = new_record("swiglu", "torch_v1", sha256(r.variant_path("swiglu", "torch_v1")),
                     agent="hand-written")
    rec["verification"] = {"cpu": {"verdict": "pass", "reasons": [], "shapes": [{"T": 1}],
                                   "seeds": [0]}}
    rec["benchmarks"] = [{"target": "h200-tp8-decode", "gpu": "NVIDIA H200", "shape": {"T": 1},
                          "median_us": 2.5, "iqr_us": 0.1, "x_reference": 1.8, "x_compile": 1.1,
                          "pct_of_floor": 40.0, "meaningful": True}]
    r.write_record("swiglu", "torch_v1", rec)
    return r


def cli(*args: str):
    # rich reads COLUMNS at print time: wide enough that no cell wraps.
    return CliRunner().invoke(app, list(args), catch_exceptions=False, env={"COLUMNS": "240"})


def test_list_shows_status_and_flags_modified_files(reg):
    out = cli("registry", "list", "--registry", str(reg.root))
    assert out.exit_code == 0, out.output
    assert "torch_v1" in out.output and "candidate" in out.output and "1.80x" in out.output
    assert "unrecorded" in out.output  # torch_v2 has no record
    path = reg.variant_path("swiglu", "torch_v1")
    path.write_text(path.read_text() + "# edit\n")
    out = cli("registry", "list", "--registry", str(reg.root))
    assert out.exit_code == 1 and "MODIFIED" in out.output and "immutable" in out.output


def test_show_and_json(reg):
    out = cli("registry", "show", "swiglu", "torch_v1", "--registry", str(reg.root))
    assert out.exit_code == 0 and "hand-written" in out.output and "verified on cpu: pass" in \
        out.output and "h200-tp8-decode" in out.output
    out = cli("registry", "show", "swiglu", "torch_v1", "--registry", str(reg.root), "--json")
    assert json.loads(out.output)["sha256"] == sha256(reg.variant_path("swiglu", "torch_v1"))
    out = cli("registry", "show", "swiglu", "nope", "--registry", str(reg.root))
    assert out.exit_code == 1


def test_diff(reg):
    out = cli("registry", "diff", "swiglu", "torch_v1", "torch_v2", "--registry", str(reg.root))
    assert out.exit_code == 0
    assert "-    return gate * up" in out.output and "+    return up * gate" in out.output


def test_lock_requires_accepted_then_shows_it(reg):
    base = ("registry", "lock", "--registry", str(reg.root), "--arch", "sm_90")
    out = cli(*base, "--op", "swiglu", "--variant", "torch_v1")
    assert out.exit_code == 1 and "not 'accepted'" in out.output
    out = cli("registry", "set-status", "swiglu", "torch_v1", "accepted", "--reason", "1.8x",
              "--registry", str(reg.root))
    assert out.exit_code == 0
    out = cli(*base, "--op", "swiglu", "--variant", "torch_v1")
    assert out.exit_code == 0 and "sm_90" in out.output
    out = cli("registry", "lock", "--registry", str(reg.root))
    assert out.exit_code == 0 and "torch_v1" in out.output and "accepted" in out.output
    out = cli(*base, "--op", "swiglu", "--unset")
    assert out.exit_code == 0 and reg.lock("sm_90") == {}
