"""benchmarks/gpu_kernels.py, the H200 script, exercised end to end on CPU (--dry-run)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from model.registry import Registry, sha256, shipped_root

DEFAULT_ROOT = shipped_root()


def load_script():
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_kernels.py"
    spec = importlib.util.spec_from_file_location("gpu_kernels_script", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _with_gpu_rows(root: Path, ops: tuple[str, ...], name: str) -> Registry:
    """A copy of the shipped `ops` whose `name` records also hold an H200 timing row, as a
    record timed on the GPU in an earlier run does."""
    import shutil

    for op in ops:
        shutil.copytree(DEFAULT_ROOT / op, root / op)
        path = root / op / "records" / f"{name}.json"
        data = json.loads(path.read_text())
        data["benchmarks"].append({"op": op, "impl": name, "shape": {"T": 1}, "median_us": 3.0,
                                   "reference_us": 6.0, "x_reference": 2.0, "device": "cuda",
                                   "gpu": "NVIDIA H200", "meaningful": True})
        path.write_text(json.dumps(data, indent=2))
    return Registry(root)


def test_dry_run_verifies_times_and_writes_records(tmp_path, capsys):
    script = load_script()
    # Two ops (a norm and an elementwise op) keep it short; the logic is the same for all five.
    # Their records hold H200 rows from an earlier run, which a CPU run must keep.
    ops = ("rmsnorm", "attn_output_gate")
    reg = _with_gpu_rows(tmp_path / "reg", ops, "triton_v2")
    code = script.main(["--dry-run", "--ops", ",".join(ops), "--variants", "triton_v2",
                        "--registry", str(reg.root), "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert code == 0, out
    out_reg = Registry(tmp_path / "out")  # $OUT is a registry, written by the registry's writer
    for op in ops:
        rec = out_reg.read_record(op, "triton_v2")
        committed = reg.read_record(op, "triton_v2")
        assert [b for b in committed.benchmarks if b.gpu != "cpu"]  # H200 rows to keep
        assert rec.variant.sha256 == sha256(DEFAULT_ROOT / op / "triton_v2.py")
        assert rec.status == committed.status  # what the review decided is kept
        assert rec.verdicts()["cpu"] == "pass"
        assert rec.verification["sm_90"] == committed.verification["sm_90"]  # other arch kept
        rows = [b for b in rec.benchmarks if b.gpu == "cpu"]
        assert [b.shape["T"] for b in rows] == [1, 3]
        assert all(b.get("target") == "cpu-tiny" and b.meaningful is False for b in rows)
        # The GPU rows committed before stay: this run measured another device.
        assert [b for b in rec.benchmarks if b.gpu != "cpu"] == \
            [b for b in committed.benchmarks if b.gpu != "cpu"]
        assert f"{op:<20} triton_v2   pass" in out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["arch"] == "cpu" and len(summary["results"]) == 2


def test_gpu_plan_uses_beam_tp8_rank_shapes():
    script = load_script()
    plan = script.bench_plan("attn_output_gate", "cuda", dry=False)
    assert [t for t, _ in plan] == ["h200-tp8-decode"] * 4 + ["h200-tp8-prefill"] * 2
    assert [s["T"] for _, s in plan] == [1, 8, 32, 128, 2048, 16384]
    assert all(s["Hq"] == 6 and s["D"] == 128 for _, s in plan)  # 48 heads / TP8
    assert script.bench_plan("norm_residual_norm", "cuda", dry=False)[0][1]["H"] == 5120


def test_attention_is_timed_over_the_keys_the_targets_serve():
    # Timed at S = T, decode attention had one key at T = 1: the rows said nothing of serving.
    from autoopt.targets import load_target

    plan = load_script().bench_plan("attention", "cuda", False, (1, 64), (2048,))
    decode_ctx = load_target("h200-tp8-decode").contexts[0]
    decode = [s for t, s in plan if t == "h200-tp8-decode"]
    assert [(s["T"], s["S"], s["seqs"]) for s in decode] == [(1, decode_ctx, 0)] * 2 + \
        [(64, decode_ctx, 0)] * 2
    assert sorted({s["W"] for s in decode}) == [0, 512]  # a full-attention and a window layer
    prefill = [s for t, s in plan if t == "h200-tp8-prefill"]
    assert all(s["T"] == 2048 and s["seqs"] == 1 and s["S"] == 2048 for s in prefill)


def test_bench_only_times_a_variant_verified_earlier_and_keeps_its_verification(tmp_path, capsys):
    script = load_script()
    code = script.main(["--dry-run", "--ops", "rmsnorm", "--bench-only", "rmsnorm/triton_v2",
                        "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "verifying 0 variants" in out  # nothing else ran
    rec = Registry(tmp_path).read_record("rmsnorm", "triton_v2")
    committed = Registry(DEFAULT_ROOT).read_record("rmsnorm", "triton_v2")
    assert rec.verification == committed.verification  # kept, not made again
    assert [b.shape["T"] for b in rec.benchmarks if b.gpu == "cpu"] == [1, 3]


def test_a_verdict_reaches_the_registry_before_the_timing(tmp_path, monkeypatch, capsys):
    # A stage cut off while timing must keep the verdict where `--bench-only` finds it.
    import shutil

    script = load_script()
    reg_root = tmp_path / "reg"
    shutil.copytree(DEFAULT_ROOT / "rmsnorm", reg_root / "rmsnorm")
    before = Registry(reg_root).read_record("rmsnorm", "triton_v2")

    def cut_off(*args, **kwargs):
        raise KeyboardInterrupt("the stage's time ran out")

    monkeypatch.setattr(script, "bench", cut_off)
    with pytest.raises(KeyboardInterrupt):
        script.main(["--dry-run", "--ops", "rmsnorm", "--variants", "triton_v2",
                     "--registry", str(reg_root), "--write-registry",
                     "--out", str(tmp_path / "out")])
    rec = Registry(reg_root).read_record("rmsnorm", "triton_v2")
    made = rec.verification["cpu"][-1]
    assert made.verdict == "pass" and made.report != before.verification["cpu"][-1].report
    # Timed in a later call: the verdict is kept and the rows join it.
    monkeypatch.undo()
    script = load_script()
    code = script.main(["--dry-run", "--ops", "rmsnorm", "--bench-only", "rmsnorm/triton_v2",
                        "--registry", str(reg_root), "--write-registry",
                        "--out", str(tmp_path / "out2")])
    assert code == 0, capsys.readouterr().out
    after = Registry(reg_root).read_record("rmsnorm", "triton_v2")
    assert after.verification == rec.verification
    assert [b.shape["T"] for b in after.benchmarks if b.gpu == "cpu"][-2:] == [1, 3]


def test_bench_only_refuses_a_variant_without_a_passing_verification_here(tmp_path, capsys):
    script = load_script()
    # attention/flashinfer_v1 has no verification on any arch: it must be verified, not timed.
    code = script.main(["--dry-run", "--ops", "attention", "--bench-only",
                        "attention/flashinfer_v1", "--out", str(tmp_path)])
    assert code == 2
    assert "verify it instead" in capsys.readouterr().err


def test_a_composite_is_timed_beside_the_composition_of_its_locked_parts(tmp_path):
    from types import SimpleNamespace

    from tests.registry_support import lock_shipped

    reg = lock_shipped(tmp_path / "reg", "attn_output_gate", "triton_v2", "cpu")
    args = SimpleNamespace(registry=reg.root, out=tmp_path / "out", dry_run=True, warmup=1,
                           iters=2)
    plan = [("cpu-tiny", {"T": t, "Hq": 2, "D": 32, "H": 16}) for t in (1, 3)]
    rows = [{"shape": dict(s), "median_us": 10.0} for _, s in plan]
    got = load_script().with_selection("gated_o_proj", rows, plan, "cpu", args)
    assert [r["selection"] for r in got] == ["composed: attn_output_gate/triton_v2 + library"] * 2
    assert all(r["selection_us"] > 0 and r["x_selection"] == r["selection_us"] / 10.0
               for r in got)
    assert (args.out / "composed" / "gated_o_proj.py").is_file()
    # Any other op, or no locked part: the rows are left as they were.
    plain = [{"shape": {"T": 1, "H": 16}, "median_us": 1.0}]
    assert load_script().with_selection("rmsnorm", plain, [("-", {"T": 1, "H": 16})], "cpu",
                                        args) == [{"shape": {"T": 1, "H": 16}, "median_us": 1.0}]


@pytest.mark.parametrize("how", ["cut_off", "fails"])
def test_timed_shapes_are_kept_when_the_stage_is_cut_off_and_dropped_when_the_run_fails(
        tmp_path, monkeypatch, capsys, how):
    # Rows are written shape by shape: a stage whose time runs out after the first shape keeps
    # it; a timing run that fails at its end (the worker caught attempting blocked operations)
    # leaves no rows of its own.
    import shutil

    from autoopt import registry_record
    from autoopt.eval import bench as eval_bench

    script = load_script()
    reg_root = tmp_path / "reg"
    shutil.copytree(DEFAULT_ROOT / "rmsnorm", reg_root / "rmsnorm")
    real = eval_bench._row
    made = []

    def row_then_stop(*args, **kwargs):
        made.append(real(*args, **kwargs))
        if len(made) == 2:  # the second shape's row is made, then the stage ends
            if how == "cut_off":
                raise KeyboardInterrupt("the stage's time ran out")
        return made[-1]

    monkeypatch.setattr(eval_bench, "_row", row_then_stop)
    if how == "fails":
        real_bench = registry_record.bench

        def failing(*args, **kwargs):
            real_bench(*args, **kwargs)
            raise RuntimeError("the variant attempted blocked operations: ['socket']")

        monkeypatch.setattr(registry_record, "bench", failing)
    argv = ["--dry-run", "--ops", "rmsnorm", "--bench-only", "rmsnorm/triton_v2",
            "--registry", str(reg_root), "--write-registry", "--out", str(tmp_path / "out")]
    if how == "cut_off":
        with pytest.raises(KeyboardInterrupt):
            script.main(argv)
    else:
        assert script.main(argv) == 1
    rec = Registry(reg_root).read_record("rmsnorm", "triton_v2")
    cpu_rows = [b.shape["T"] for b in rec.benchmarks if b.gpu == "cpu"]
    assert cpu_rows == ([1] if how == "cut_off" else [])
    assert "blocked operations" in capsys.readouterr().out or how == "cut_off"
