"""`autoopt profile --target cpu-tiny` end to end on the CPU (the torch.profiler fallback)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from autoopt.cli import app
from autoopt.profiler.attribution import IDLE, OTHER, Profile
from autoopt.targets import load_target
from model.ops import CONTRACTS

runner = CliRunner()
WIDE = {"COLUMNS": "200"}
# Every op contract the tiny model calls (it has dense and MoE layers, sliding and full
# attention); allreduce_norm_residual_norm only runs under TP > 1.
MODEL_OPS = {"rmsnorm", "norm_residual_norm", "qkv_gate_proj", "qk_norm_rope", "qk_norm_ssmax",
             "attention", "gated_o_proj", "router", "moe_experts", "swiglu", "logit_softcap"}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    result = runner.invoke(app, ["profile", "--target", "cpu-tiny", "--out", str(out)], env=WIDE)
    assert result.exit_code == 0, result.output
    return out, result.output


@pytest.fixture(scope="module")
def prof(run_dir) -> Profile:
    return Profile.load(run_dir[0] / "profile.json")


def test_outputs_written(run_dir, prof):
    out, text = run_dir
    assert (out / "profile.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "profile.json").read_text())
    assert data["schema"] == "autoopt.profile/2" and data["target"] == "cpu-tiny"
    for col in ("op", "calls", "kernels", "time", "share", "bytes", "GB/s", "floor", "gap"):
        assert col in text
    assert "torch.profiler" in text  # the fallback is stated
    assert prof.backend == "torch" and prof.gpu == "cpu" and prof.proxy is None


def test_shares_sum_to_100(prof):
    # Shares are rounded only in the table; stored ones sum to 100 up to float error.
    assert abs(sum(r.share for r in prof.rows) - 100.0) <= 0.5
    assert prof.rows[-1].op == IDLE
    assert prof.kernel_us + prof.row(IDLE).time_us == pytest.approx(prof.step_us, rel=1e-6)


def test_every_model_op_appears(prof):
    assert MODEL_OPS <= set(CONTRACTS)
    present = {r.op for r in prof.rows if r.kernels > 0 and r.time_us > 0}
    assert MODEL_OPS <= present, MODEL_OPS - present
    for region in ("embed", "lm_head", "paged_attention"):
        assert region in present


def test_calls_match_the_step_structure(prof):
    # Measured range entries equal the static count from the target (nothing double-counted).
    want: dict[str, int] = {}
    for c in load_target("cpu-tiny").step_calls(prof.batch, prof.layers, prof.context):
        want[c.name] = want.get(c.name, 0) + c.count
    for op, n in want.items():
        assert prof.row(op).calls == n, op


def test_floors_and_gaps(prof):
    for r in prof.ops():
        if r.op in MODEL_OPS:
            assert r.floor_us is not None and r.floor_us > 0
            assert r.gap_us == pytest.approx(r.time_us - r.floor_us)
            assert r.bytes_source == "cost model" and r.bytes > 0
    assert not prof.rates.meaningful  # CPU floors are nominal, and say so
    ranked = prof.ranked()
    assert [r.op for r in ranked] and set(r.op for r in ranked) <= MODEL_OPS


def test_compare(run_dir, tmp_path):
    a = run_dir[0] / "profile.json"
    data = json.loads(a.read_text())
    data["batch"] = 5
    for row in data["rows"]:
        row["time_us"] /= 2
    b = tmp_path / "tuned.json"
    b.write_text(json.dumps(data))
    result = runner.invoke(app, ["profile", "--compare", str(a), str(b)], env=WIDE)
    assert result.exit_code == 0, result.output
    assert "speedup" in result.output and "2.00x" in result.output
    assert "differ in batch: 3 vs 5" in result.output


def test_profile_errors(tmp_path):
    result = runner.invoke(app, ["profile"], env=WIDE)
    assert result.exit_code == 2 and "--target" in result.output
    not_json = tmp_path / "x.json"
    not_json.write_text("{}")
    result = runner.invoke(app, ["profile", "--compare", str(not_json), str(not_json)], env=WIDE)
    assert result.exit_code == 2 and "not an autoopt profile" in result.output
    result = runner.invoke(app, ["profile", "--target", "cpu-tiny", "--backend", "nsys"], env=WIDE)
    assert result.exit_code == 2 and "unknown backend 'nsys'" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusals")
def test_gpu_only_paths_refused_on_cpu():
    result = runner.invoke(app, ["profile", "--target", "cpu-tiny", "--backend", "ncu"],
                           env=WIDE)
    assert result.exit_code == 2 and "needs a CUDA GPU" in result.output
    result = runner.invoke(app, ["ceilings"], env=WIDE)
    assert result.exit_code == 2 and "no CUDA GPU" in result.output


# What may run outside every op's range: allocation, casts, views and indexing around the ops,
# and the greedy sampler's argmax. No GEMM, softmax, norm or elementwise math.
GLUE = {"aten::select", "aten::empty", "aten::empty_strided", "aten::to", "aten::_to_copy",
        "aten::copy_", "aten::lift_fresh", "aten::detach_", "aten::detach", "aten::index",
        "aten::index_select", "aten::argmax", "aten::resolve_conj", "aten::resolve_neg",
        "aten::cat", "aten::stack", "aten::view", "aten::reshape", "aten::slice",
        "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::as_strided", "aten::item",
        "aten::_local_scalar_dense", "aten::contiguous", "aten::clone", "aten::zeros",
        "aten::full", "aten::fill_", "aten::zero_", "aten::arange", "aten::t",
        "aten::transpose", "aten::permute", "aten::split", "aten::narrow"}


def test_other_row_only_holds_unranged_work(prof):
    # Glue is the only unranged work: judged by what the kernels are, not by their share of
    # the step's time (a loaded two-core machine once stretched 67 glue calls to 6.7%).
    other = [r for r in prof.rows if r.op == OTHER]
    assert len(other) <= 1
    # The unranged kernels are named in the checks, counted as the row counts them.
    by_name = prof.checks["unlabelled_by_name"]
    assert set(by_name) <= GLUE, sorted(set(by_name) - GLUE)
    assert sum(by_name.values()) <= prof.checks["unlabelled_kernels"]
    assert prof.checks["unlabelled_kernels"] == (other[0].kernels if other else 0)
    assert all(isinstance(n, str) and k > 0 for n, k in by_name.items())


def test_prefill_step_on_cpu(tmp_path):
    # A prefill twin of cpu-tiny: whole prompts through the causal backend, logits of the last
    # token of each prompt only.
    from autoopt import env
    from autoopt.profiler import profile_step

    toml = (env.tasks_dir() / "cpu-tiny.toml").read_text()
    toml = toml.replace('name = "cpu-tiny"', 'name = "cpu-tiny-prefill"').replace(
        'phase = "decode"', 'phase = "prefill"').replace("contexts = [40]", "contexts = [19]")
    path = tmp_path / "cpu-tiny-prefill.toml"
    path.write_text(toml)
    p = profile_step(path, batch=2, repeats=1)
    assert p.phase == "prefill" and p.context == 19
    assert MODEL_OPS <= {r.op for r in p.rows if r.kernels > 0}
    assert "paged_attention" in {r.op for r in p.rows}  # the backend's range, the op inside
    assert p.row("attention").calls == p.layers  # one call per layer over both prompts
    assert p.row("logit_softcap").calls == 1
    assert abs(sum(r.share for r in p.rows) - 100.0) <= 0.5
