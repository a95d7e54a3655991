"""`autoopt bench model` on the CPU (cpu-tiny), the served step under it, and the engine's
`kernels` for a model passed in."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from autoopt.bench_model import BenchModelArgs, resolve_target
from autoopt.cli import app
from autoopt.profiler.rank import build_rank_model
from autoopt.profiler.served import ServedStep, ServeShape
from autoopt.targets import load_target
from model.ops import OpTable
from model.serve.engine import EngineConfig, LLMEngine

WIDE = {"COLUMNS": "200"}


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    res = CliRunner().invoke(app, ["bench", "model", "--target", "cpu-tiny", "--batch", "1,3",
                                   "--layers", "4", "--iters", "2", "--out", str(out)], env=WIDE)
    assert res.exit_code == 0, res.output
    return out, res.output, json.loads((out / "bench_model.json").read_text())


@pytest.mark.slow
def test_outputs_and_labels(bench):
    out, text, data = bench
    assert data["schema"] == "autoopt.bench_model/1" and data["target"] == "cpu-tiny"
    assert (out / "bench_model.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "bench_model.md").read_text()
    assert "CPU: times not meaningful" in md and "| context | batch | kernels |" in md
    assert data["meaningful"] is False and data["kernels"] == ["reference", "tuned"]
    assert "not meaningful" in text and "ms/step" in text
    # Every stage's time is printed as it finishes.
    assert "model build" in text and "engine" in text


@pytest.mark.slow
def test_rows_are_served_steps_against_their_floor(bench):
    _, _, data = bench
    rows = {(r["batch"], r["kernels"]): r for r in data["rows"]}
    assert set(rows) == {(b, k) for b in (1, 3) for k in ("reference", "tuned")}
    for (b, _), r in rows.items():
        assert r["ran"] and len(r["samples_ms"]) == 2 and r["context"] == 40
        assert r["median_ms"] > 0 and r["tokens_per_s"] == pytest.approx(b / r["median_ms"] * 1e3)
        assert r["x_floor"] == pytest.approx(r["median_ms"] / r["floor_ms"])
        assert r["kernels_per_step"] > 0 and r["kernels_per_layer"] == pytest.approx(
            r["kernels_per_step"] / 4)
        assert r["graph_bucket"] is None  # no CUDA graphs on the CPU
    # On the CPU the tuned set is the reference (no cpu lock): bitwise the same logits.
    for b in (1, 3):
        par = rows[(b, "tuned")]["parity"]
        assert par["max_abs_diff"] == 0.0 and par["top1_agree"]
        assert rows[(b, "tuned")]["speedup"]["reference"] == pytest.approx(
            rows[(b, "reference")]["median_ms"] / rows[(b, "tuned")]["median_ms"])
    f1, f3 = data["floors"]["40/1"], data["floors"]["40/3"]
    assert f1["experts_touched"] == [8] and f1["routing"] == "recorded"  # top-8 of one token
    assert f3["weight_bytes"] > f1["weight_bytes"] and f3["kv_bytes"] == 3 * f1["kv_bytes"]


@pytest.mark.slow
def test_kernels_are_counted_per_op_and_per_attention_block(bench):
    from autoopt.bench_model import ATTENTION_BLOCK

    out, _, data = bench
    for r in data["rows"]:
        by_op = r["kernels_by_op"]
        # Every op of the block launched, and the per-op counts label the counted step's kernels
        # (each counted once, unlabelled ones as `other`).
        assert {"qkv_gate_proj", "attention", "gated_o_proj"} <= set(by_op), by_op
        assert sum(by_op.values()) == r["kernels_per_step"], by_op
        block = sum(n for op, n in by_op.items() if op in ATTENTION_BLOCK)
        assert r["attention_block_kernels"] == pytest.approx(block / 4)
        assert 0 < r["attention_block_kernels"] < r["kernels_per_layer"]
    md = (out / "bench_model.md").read_text()
    assert "| attention block |" in md and "Kernels per op in that step" in md


def test_prefill_phase_and_bad_flags():
    t, batches, contexts = resolve_target(BenchModelArgs("h200-tp8-decode", phase="prefill"))
    assert (t.phase, batches, contexts) == ("prefill", (8,), (2048,))
    with pytest.raises(ValueError, match="--phase"):
        BenchModelArgs("cpu-tiny", phase="train")
    res = CliRunner().invoke(app, ["bench", "model", "--target", "cpu-tiny", "--batch", "x"],
                             env=WIDE)
    assert res.exit_code == 2 and "comma-separated integers" in res.output


def test_bench_op_is_still_reachable_without_the_sub_command():
    res = CliRunner().invoke(app, ["bench"], env=WIDE)
    assert res.exit_code == 2 and "bench model --target" in res.output


def test_served_decode_rows_are_real_sequences():
    t = load_target("cpu-tiny")
    rank = build_rank_model(t, 4, "cpu", 0)
    served = ServedStep(rank.model, ServeShape("decode", 4, 40, steps=3), cuda_graphs=False)
    served.start(3)
    eng = served.engine
    seqs = list(eng.scheduler.running)
    assert len(seqs) == 3 and all(s.num_computed == 39 and s.is_decoding for s in seqs)
    pages = [eng.cache.page_tables(s.seq_id)[0] for s in seqs]
    assert len({p for table in pages for p in table}) == sum(len(p) for p in pages)  # own pages
    assert all(len(p) == 3 for p in pages)  # 40 tokens in pages of 16
    served.step()
    assert all(s.num_computed == 40 and len(s.output_ids) == 1 for s in seqs)
    served.step(), served.step()
    assert served.steps_left() == 0
    served.step()  # restarts fresh sequences rather than running out
    assert all(s.num_computed == 40 for s in eng.scheduler.running)
    served.stop()
    eng.cache.check_no_leaks(set())


def test_served_prefill_runs_whole_prompts_in_one_step():
    t = load_target("cpu-tiny")
    rank = build_rank_model(t, 4, "cpu", 0)
    served = ServedStep(rank.model, ServeShape("prefill", 2, 24), cuda_graphs=False)
    served.start(2)
    before = served.engine.stats().batched_tokens_total
    served.step()
    assert served.engine.stats().batched_tokens_total - before == 48
    served.engine.cache.check_no_leaks(set())  # the prompts finished with their step


def _custom_table() -> OpTable:
    from model.ops import CONTRACTS

    return OpTable({"swiglu": CONTRACTS["swiglu"].reference}, {"swiglu": "mine"})


def test_engine_honours_kernels_for_a_model_passed_in():
    t = load_target("cpu-tiny")
    cfg = dict(device="cpu", max_num_seqs=2, max_model_len=64, kv_cache_bytes=8 << 20)
    model = build_rank_model(t, 4, "cpu", 0).model
    model.set_ops(_custom_table())
    LLMEngine(EngineConfig(kernels="reference", **cfg), model=model)
    assert model.ops.sources["swiglu"] == "reference"  # the config's set, not the model's
    model.set_ops(_custom_table())
    LLMEngine(EngineConfig(kernels=None, **cfg), model=model)
    assert model.ops.sources["swiglu"] == "mine"  # None keeps the passed model's ops
    with pytest.raises(Exception, match="no such lock file"):
        LLMEngine(EngineConfig(kernels="missing.lock.toml", **cfg), model=model)
    assert torch.isfinite(model.embed_tokens).all()


def test_timed_steps_stop_after_row_s_but_keep_five(monkeypatch):
    from types import SimpleNamespace

    from autoopt import bench_model

    calls = []  # one per step; each step takes 4 s of a fake clock
    monkeypatch.setattr(bench_model, "time", SimpleNamespace(monotonic=lambda: 4.0 * len(calls)))

    def slow_step():
        calls.append(1)
        return 4.0

    def run(iters, row_s):
        calls.clear()
        got = bench_model.timed_steps(slow_step, iters=iters, row_s=row_s)
        assert len(got) == len(calls) and set(got) == {4000.0}
        return len(got)

    assert bench_model.MIN_SAMPLES == 5
    assert run(20, 10.0) == 5  # 10 s are gone after 3 steps; 5 are kept
    assert run(3, 10.0) == 3  # iters still bounds it
    assert run(20, 30.0) == 8  # the step that crosses 30 s is the last
    assert run(20, None) == 20
    with pytest.raises(ValueError, match="row-s"):
        bench_model.BenchModelArgs("cpu-tiny", row_s=0)


def test_compile_set_runs_the_recorded_library_moe_where_it_can(tmp_path):
    # The compile set's moe_experts cannot be compiled (its reference syncs with the host): it
    # runs the registry's grouped_mm_v2 where that is recorded and verified for this arch, so the
    # step replays from a graph, and the reference (said in the notes) where the registry lacks it.
    from autoopt.profiler.kernel_sets import kernel_set
    from model.registry import Registry
    from model.registry.paths import shipped_root

    cpu = torch.device("cpu")
    ks = kernel_set("compile", cpu)
    assert ks.table.sources["moe_experts"].startswith("grouped_mm_v2")
    assert any("runs moe_experts/grouped_mm_v2" in n for n in ks.notes)
    assert ks.table.sources["rmsnorm"] == "reference (torch.compile, Inductor)"

    Registry(tmp_path / "empty").root.mkdir(parents=True)
    bare = kernel_set("compile", cpu, registry=tmp_path / "empty")
    assert bare.table.sources.get("moe_experts", "reference") == "reference"
    assert any("moe_experts not compiled" in n and "eagerly" in n for n in bare.notes)
    # Its file changed after recording: refused, as a lock entry would be.
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(shipped_root(), copy)
    path = copy / "moe_experts" / "grouped_mm_v2.py"
    path.write_text(path.read_text() + "\n# edited\n")
    edited = kernel_set("compile", cpu, registry=copy)
    assert edited.table.sources.get("moe_experts", "reference") == "reference"
    assert any("hashes to" in n for n in edited.notes), edited.notes


def test_reference_graphs_is_the_reference_with_a_capturable_moe(tmp_path):
    # The optimize loop's end-to-end baseline on a GPU: the plain reference's MoE syncs with the
    # host, so its step runs eagerly (398 ms at bs 1 on an H200, which no server does).
    from autoopt.profiler.kernel_sets import kernel_set
    from model.ops import CONTRACTS

    cpu = torch.device("cpu")
    ks = kernel_set("reference-graphs", cpu)
    assert ks.table.sources["moe_experts"].startswith("grouped_mm_v2")
    assert all(ks.table.sources.get(op, "reference") == "reference" for op in CONTRACTS
               if op != "moe_experts")
    assert any("runs moe_experts/grouped_mm_v2" in n for n in ks.notes)
    (tmp_path / "empty").mkdir()
    bare = kernel_set("reference-graphs", cpu, registry=tmp_path / "empty")
    assert bare.table.sources.get("moe_experts", "reference") == "reference"
    assert any("eagerly" in n for n in bare.notes)


def test_first_fit_runs_each_batch_at_the_first_context_where_it_fits(monkeypatch):
    # A TP8 rank's weights leave no room for bs 32 and 64 at 100k keys on one H200: the loop's
    # end-to-end check runs those at the target's next context instead of not at all.
    from autoopt import bench_model

    real = bench_model.fitting_batches

    def fits(target, batches, context, layers, free):
        keep, notes = real(target, batches, context, layers, free)
        if context == 48:
            notes = [f"context 48, batch {b}: not run (too big)" for b in batches if b > 1]
            keep = [b for b in keep if b == 1]
        return keep, notes

    monkeypatch.setattr(bench_model, "fitting_batches", fits)
    args = BenchModelArgs("cpu-tiny", batches=(1, 3), contexts=(48, 40), layers=2, iters=1,
                          warmup=0, first_fit=True, count_kernels=False)
    res = bench_model.run_bench(args, say=lambda line: None)
    ran = sorted((r.batch, r.context, r.kernels) for r in res.rows if r.ran)
    assert ran == [(1, 48, "reference"), (1, 48, "tuned"), (3, 40, "reference"),
                   (3, 40, "tuned")]
    assert not [r for r in res.rows if not r.ran]
    assert any("context 48: batch 3 run at context 40" in n for n in res.notes)
    # Without first_fit every batch is tried at every context; what does not fit says so.
    args = BenchModelArgs("cpu-tiny", batches=(1, 3), contexts=(48, 40), layers=2, iters=1,
                          warmup=0, count_kernels=False)
    res = bench_model.run_bench(args, say=lambda line: None)
    assert {(r.batch, r.context) for r in res.rows if not r.ran} == {(3, 48)}
    assert {(r.batch, r.context) for r in res.rows if r.ran} == {(1, 48), (1, 40), (3, 40)}


def test_tuned_plus_compile_keeps_the_lock_and_compiles_the_rest(tmp_path):
    # The set a server would run if it compiled what the registry has no kernel for: the lock's
    # variants as they are, Inductor for the other ops (composites composed from their parts).
    from autoopt.profiler.kernel_sets import kernel_set
    from tests.registry_support import torch_registry

    reg = torch_registry(tmp_path / "reg", ops=("rmsnorm", "swiglu"))
    ks = kernel_set("tuned+compile", torch.device("cpu"), registry=reg.root)
    src = ks.table.sources
    assert src["rmsnorm"].startswith("torch_v1") and src["swiglu"].startswith("torch_v1")
    assert src["router"] == src["attention"] == "reference (torch.compile, Inductor)"
    assert src["gated_o_proj"] == "reference"  # composed from the compiled parts
    assert src["moe_experts"] == "reference"  # as the server runs it: nothing stands in
    assert any("compiled by Inductor" in n and "rmsnorm" not in n for n in ks.notes)
    assert ks.label == "tuned+compile"
    # The compiled ops compute the reference's function (Inductor keeps its roundings; its
    # CPU tanh/sigmoid may differ by an ulp).
    from autoopt.eval.numerics import ulp_diff
    from model.ops import contract

    for op in ("logit_softcap", "attn_output_gate"):
        c = contract(op)
        inputs = c.make_inputs({**c.tests.cpu_dims, "T": 3}, 0)
        got, want = ks.table.impl(op)(*inputs), c.reference(*inputs)
        assert got.shape == want.shape and int(ulp_diff(got, want).abs().max()) <= 1, op


def test_the_engine_serves_tuned_plus_compile():
    t = load_target("cpu-tiny")
    cfg = dict(device="cpu", max_num_seqs=2, max_model_len=64, kv_cache_bytes=8 << 20)
    model = build_rank_model(t, 2, "cpu", 0).model
    LLMEngine(EngineConfig(kernels="tuned+compile", **cfg), model=model)
    assert model.ops.sources["router"] == "reference (torch.compile, Inductor)"
    assert model.ops.sources["moe_experts"] == "reference"  # its host sync cannot be compiled


def test_count_kernels_labels_the_replayed_step_with_the_eager_pass(monkeypatch):
    """With a captured graph the total is the replay's kernels, and each takes the op of its
    match in the labelled eager pass: per-op counts sum to the total even when the two passes
    differ (a kernel the replay alone launches counts as `other`; one only the eager pass
    launches counts nowhere)."""
    import contextlib

    from autoopt.bench_model import count_kernels
    from autoopt.profiler import torch_trace
    from autoopt.profiler.attribution import OTHER, KernelRecord
    from autoopt.profiler.torch_trace import Trace

    labelled = [KernelRecord("gemv", "qkv_gate_proj", 1.0),
                KernelRecord("norm", "qk_norm_rope", 1.0),
                KernelRecord("eager_only", "attention", 1.0),
                KernelRecord("attn", "attention", 1.0),
                KernelRecord("gemv", "gated_o_proj", 1.0)]
    replay = [KernelRecord("gemv", OTHER, 1.0, in_graph=True),
              KernelRecord("norm", OTHER, 1.0, in_graph=True),
              KernelRecord("attn", OTHER, 1.0, in_graph=True),
              KernelRecord("capture_only", OTHER, 1.0, in_graph=True),
              KernelRecord("gemv", OTHER, 1.0, in_graph=True),
              KernelRecord("copy", OTHER, 1.0, kind="memcpy")]
    state = {"eager": False}

    class Served:
        device = torch.device("cpu")

        def __init__(self, bucket):
            self._bucket = bucket

        def bucket(self):
            return self._bucket

        @contextlib.contextmanager
        def eager(self):
            state["eager"] = True
            yield []
            state["eager"] = False

        def step(self):
            return None

    def fake_trace(run, device, ranges=True, keep=None):
        assert ranges == state["eager"]  # ranges only in the labelled (eager) pass
        return Trace(list(labelled if state["eager"] else replay), {}, 1.0, "cpu")

    monkeypatch.setattr(torch_trace, "trace_call", fake_trace)
    total, by_op = count_kernels(Served(bucket=1))
    assert total == 5  # the replay's kernels, not its copy
    assert by_op == {"attention": 1, "gated_o_proj": 1, "other": 1, "qk_norm_rope": 1,
                     "qkv_gate_proj": 1} and sum(by_op.values()) == total
    total, by_op = count_kernels(Served(bucket=None))  # no graph: the labelled pass is the step
    assert total == 5 and by_op["attention"] == 2
