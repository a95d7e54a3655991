"""Profiler internals on synthetic data: trace and Nsight parsing, attribution arithmetic.

The GPU paths (CUPTI kernels in a torch.profiler trace, Nsight Compute reports) cannot run on
the CPU; these tests feed them hand-made inputs in the documented formats.
"""

from __future__ import annotations

import csv
import io
import stat
import sys
import textwrap
import types

import pytest

from autoopt.profiler import nsight
from autoopt.profiler.attribution import (
    IDLE,
    OTHER,
    KernelRecord,
    Rates,
    align_by_order,
    attribute,
    innermost,
)
from autoopt.profiler.torch_trace import _Segments, parse_chrome_trace
from autoopt.targets import OpCall
from model.ops import Cost


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1,
            "args": args}


def test_segments_pick_the_innermost_range():
    seg = _Segments([(0, 100, "autoopt_step"), (10, 40, "o_proj"), (20, 30, "attention"),
                     (50, 60, "rmsnorm")])
    assert [seg.at(t) for t in (5, 15, 25, 35, 45, 55, 99, 100)] == [
        "autoopt_step", "o_proj", "attention", "o_proj", "autoopt_step", "rmsnorm",
        "autoopt_step", OTHER]


def test_chrome_trace_gpu_kernels_attributed_through_their_launch():
    events = [
        _x("user_annotation", "autoopt_step", 0, 100),
        _x("user_annotation", "rmsnorm", 10, 10),
        _x("user_annotation", "moe_experts", 30, 40),
        _x("user_annotation", "moe_experts", 75, 10),
        _x("cuda_runtime", "cudaLaunchKernel", 12, 2, correlation=1),
        _x("cuda_runtime", "cudaLaunchKernel", 35, 2, correlation=2),
        _x("cuda_driver", "cuLaunchKernel", 50, 2, correlation=3),
        _x("cuda_runtime", "cudaLaunchKernel", 90, 2, correlation=4),  # outside every op
        _x("cuda_runtime", "cudaLaunchKernel", 150, 2, correlation=5),  # after the step
        _x("kernel", "rms_kernel", 1000, 7.5, tid=7, correlation=1),
        _x("kernel", "gemm", 1010, 20.0, tid=7, correlation=2),
        _x("kernel", "gemm", 1031, 30.0, tid=7, correlation=3),
        _x("gpu_memcpy", "Memcpy DtoD", 1070, 1.0, tid=7, correlation=4),
        _x("kernel", "late", 1200, 5.0, tid=7, correlation=5),
    ]
    trace = parse_chrome_trace(events)
    assert trace.device == "cuda" and trace.step_range_us == 100
    assert [(r.name, r.op, r.duration_us, r.kind) for r in trace.records] == [
        ("rms_kernel", "rmsnorm", 7.5, "kernel"), ("gemm", "moe_experts", 20.0, "kernel"),
        ("gemm", "moe_experts", 30.0, "kernel"), ("Memcpy DtoD", OTHER, 1.0, "memcpy")]
    assert trace.calls == {"rmsnorm": 1, "moe_experts": 2}


def test_chrome_trace_cpu_uses_top_level_ops():
    events = [
        _x("user_annotation", "autoopt_step", 0, 100),
        _x("user_annotation", "swiglu", 10, 30),
        _x("cpu_op", "aten::mul", 12, 10),
        _x("cpu_op", "aten::empty", 13, 1),  # nested in aten::mul: not a kernel of its own
        _x("cpu_op", "aten::to", 25, 10),
        _x("cpu_op", "aten::cat", 60, 5),
        _x("cpu_op", "aten::add", 60, 5, tid=2),  # another thread
    ]
    trace = parse_chrome_trace(events)
    assert trace.device == "cpu"
    assert [(r.name, r.op, r.duration_us) for r in trace.records] == [
        ("aten::mul", "swiglu", 10.0), ("aten::to", "swiglu", 10.0), ("aten::cat", OTHER, 5.0)]


def test_chrome_trace_without_step_range_is_an_error():
    with pytest.raises(ValueError, match="no 'autoopt_step' range"):
        parse_chrome_trace([_x("cpu_op", "aten::mul", 0, 1)])


def test_attribute_shares_floors_and_idle():
    recs = [KernelRecord("a", "rmsnorm", 30.0, 3000), KernelRecord("b", "moe_experts", 50.0, 9000),
            KernelRecord("c", OTHER, 5.0, 10)]
    expected = [OpCall("rmsnorm", {"T": 1}, 2, Cost(bytes=1000, flops=0)),
                OpCall("moe_experts", {"T": 1}, 1, Cost(bytes=2000, flops=4000)),
                OpCall("router", {"T": 1}, 1, Cost(bytes=100, flops=3000))]
    # 1 byte/ns; FP32 FMAs slow, so the router is FLOP-bound at a third of the BF16 rate (exact
    # three-term BF16 products beat 1 MFLOP/s of FMAs).
    rates = Rates(1e9, 1e9, 1e6, "test")
    rows, kernel_us, floor_us = attribute(recs, {"rmsnorm": 2}, expected, rates, step_us=100.0)
    by = {r.op: r for r in rows}
    assert [r.op for r in rows] == ["moe_experts", "rmsnorm", "router", OTHER, IDLE]
    assert kernel_us == 85.0 and by[IDLE].time_us == 15.0
    assert sum(r.share for r in rows) == pytest.approx(100.0)
    assert by["rmsnorm"].floor_us == pytest.approx(2.0) and by["rmsnorm"].gap_us == 28.0
    assert by["moe_experts"].floor_us == pytest.approx(4.0)  # FLOPs bound at 1 GFLOP/s
    assert by["router"].floor_us == pytest.approx(9.0)  # 3000 FLOPs at 1e9 / 3 FLOP/s
    assert by["router"].time_us == 0.0 and by["router"].calls == 1
    assert by["rmsnorm"].bytes == 3000 and by["rmsnorm"].bytes_source == "ncu"
    assert by["moe_experts"].gbps == pytest.approx(9000 / 50.0 / 1e3)
    assert floor_us == pytest.approx(15.0)


def test_attribute_without_measured_bytes_and_kernels_over_wall():
    recs = [KernelRecord("a", "rmsnorm", 30.0), KernelRecord("b", "rmsnorm", 90.0)]
    expected = [OpCall("rmsnorm", {"T": 1}, 1, Cost(bytes=500))]
    rows, kernel_us, _ = attribute(recs, {}, expected, Rates(1e9, 1e9, 1e9, "t"), step_us=100.0)
    by = {r.op: r for r in rows}
    assert by["rmsnorm"].bytes == 500 and by["rmsnorm"].bytes_source == "cost model"
    assert by[IDLE].time_us == 0.0  # never negative: shares are then over kernel time
    assert sum(r.share for r in rows) == pytest.approx(100.0)


def test_innermost_and_alignment():
    assert innermost(["autoopt_step", "moe_experts"]) == "moe_experts"
    assert innermost(["autoopt_step", "o_proj", "not-a-range"]) == "o_proj"
    assert innermost([]) == OTHER
    ncu = [KernelRecord("k1", OTHER, 1.0, 8), KernelRecord("k2", OTHER, 2.0, 16)]
    ref = [KernelRecord("k1", "rmsnorm", 1.1), KernelRecord("m", OTHER, 0.1, kind="memcpy"),
           KernelRecord("k2", "router", 2.2)]
    aligned = align_by_order(ncu, ref)
    assert [(r.op, r.duration_us, r.dram_bytes) for r in aligned] == [("rmsnorm", 1.0, 8),
                                                                      ("router", 2.0, 16)]
    assert align_by_order(ncu, ref[:1]) is None


def _csv(rows: list[list[str]], preamble: str = "") -> str:
    buf = io.StringIO()
    csv.writer(buf, quoting=csv.QUOTE_ALL, lineterminator="\n").writerows(rows)
    return preamble + buf.getvalue()


NVTX_COL = "thread Domain:Push/Pop_Range:PL_Type:PL_Value:CLR_Type:Color:Msg_Type:Msg"
LAUNCH = ["1", "7", "(128, 1, 1)", "(1, 1, 1)", "0", "9.0", "Command line profiler metrics"]
NORM = ["0", "1", "python", "h", "<default domain>:autoopt_step/norm_residual_norm:none:none",
        "k_norm"] + LAUNCH
COPY = ["1", "1", "python", "h", "<default domain>:autoopt_step:none:none", "k_copy"] + LAUNCH
LONG_CSV = _csv([
    ["ID", "Process ID", "Process Name", "Host Name", NVTX_COL, "Kernel Name", "Context",
     "Stream", "Block Size", "Grid Size", "Device", "CC", "Section Name", "Metric Name",
     "Metric Unit", "Metric Value"],
    NORM + ["dram__bytes_read.sum", "Kbyte", "1,024.5"],
    NORM + ["dram__bytes_write.sum", "byte", "512"],
    NORM + ["gpu__time_duration.sum", "usecond", "3.25"],
    COPY + ["gpu__time_duration.sum", "nsecond", "1500"],
    COPY + ["dram__bytes_read.sum", "byte", "10"],
    COPY + ["dram__bytes_write.sum", "byte", "20"],
], preamble="==PROF== Connected to process 1\n")
WIDE_CSV = _csv([
    ["ID", "Kernel Name", "thread Domain:Push/Pop_Range", "gpu__time_duration.sum",
     "dram__bytes_read.sum", "dram__bytes_write.sum"],
    ["", "", "", "msecond", "Mbyte", "byte"],
    ["5", "gemm", "autoopt_step/moe_experts", "0.002", "1.5", "100"],
    ["6", "rms", "autoopt_step/rmsnorm", "0.001", "0", "0"],
])


def test_parse_ncu_csv_long_and_wide():
    long = nsight.parse_ncu_csv(LONG_CSV)
    assert [(r.name, r.op) for r in long] == [("k_norm", "norm_residual_norm"), ("k_copy", OTHER)]
    assert long[0].duration_us == pytest.approx(3.25) and long[0].dram_bytes == 1024500 + 512
    assert long[1].duration_us == pytest.approx(1.5) and long[1].dram_bytes == 30
    wide = nsight.parse_ncu_csv(WIDE_CSV)
    assert [(r.op, r.duration_us, r.dram_bytes) for r in wide] == [
        ("moe_experts", pytest.approx(2.0), 1500100), ("rmsnorm", pytest.approx(1.0), 0)]
    with pytest.raises(nsight.NcuError, match="no header row"):
        nsight.parse_ncu_csv("nothing here\n")


def _fake_ncu_report(actions):
    class Metric:
        def __init__(self, value, unit):
            self._v, self._u = value, unit

        def as_double(self):
            return self._v

        def unit(self):
            return self._u

    class Domain:
        def __init__(self, stack):
            self._s = stack

        def push_pop_ranges(self):
            return tuple(self._s)

    class State:
        def __init__(self, stack):
            self._d = Domain(stack)

        def domains(self):
            return [0]

        def domain_by_id(self, i):
            return self._d

    class Action:
        def __init__(self, name, stack, metrics):
            self._n, self._st, self._m = name, stack, metrics

        def name(self):
            return self._n

        def nvtx_state(self):
            return State(self._st)

        def metric_by_name(self, name):
            v = self._m.get(name)
            return None if v is None else Metric(*v)

    class Range:
        def num_actions(self):
            return len(actions)

        def action_by_idx(self, i):
            return Action(*actions[i])

    class Report:
        def num_ranges(self):
            return 1

        def range_by_idx(self, i):
            return Range()

    return types.SimpleNamespace(load_report=lambda path: Report())


def test_read_with_ncu_report(monkeypatch, tmp_path):
    fake = _fake_ncu_report([
        ("gemm", ["autoopt_step", "qkv_gate_proj"],
         {nsight.TIME: (2500.0, "nsecond"), nsight.READ: (2.0, "Mbyte"),
          nsight.WRITE: (4.0, "kbyte")}),
        ("copy", ["autoopt_step"], {nsight.TIME: (1.0, "usecond")}),
    ])
    monkeypatch.setitem(sys.modules, "ncu_report", fake)
    recs = nsight.read_with_ncu_report(tmp_path / "x.ncu-rep", "ncu")
    assert [(r.name, r.op, r.duration_us, r.dram_bytes) for r in recs] == [
        ("gemm", "qkv_gate_proj", pytest.approx(2.5), 2004000), ("copy", OTHER, 1.0, None)]


_CHILD_REPORT = """
import types
def load_report(path):
    if "crash" in path:
        import os
        os.abort()  # what a native reader crash looks like to the parent
    metric = lambda v: types.SimpleNamespace(as_double=lambda: v, unit=lambda: "nsecond")
    state = types.SimpleNamespace(domains=lambda: [0], domain_by_id=lambda i: types.SimpleNamespace(
        push_pop_ranges=lambda: ("autoopt_step", "swiglu")))
    action = types.SimpleNamespace(name=lambda: "k", nvtx_state=lambda: state,
                                   metric_by_name=lambda n: metric(1500.0) if "duration" in n
                                   else None)
    rng = types.SimpleNamespace(num_actions=lambda: 2, action_by_idx=lambda i: action)
    return types.SimpleNamespace(num_ranges=lambda: 1, range_by_idx=lambda i: rng)
"""


def test_report_is_read_in_a_child_process_and_a_crash_is_an_error(monkeypatch, tmp_path):
    # The ncu_report extension once crashed its host process; the reader runs in a child, so
    # a crash becomes an NcuError that run_ncu answers with the CSV fallback.
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "ncu_report.py").write_text(_CHILD_REPORT)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "mods"))
    recs = nsight.read_in_child(tmp_path / "ok.ncu-rep", "ncu", timeout_s=120)
    assert [(r.name, r.op, r.duration_us, r.dram_bytes) for r in recs] == [
        ("k", "swiglu", pytest.approx(1.5), None)] * 2
    with pytest.raises(nsight.NcuError, match="reader exited"):
        nsight.read_in_child(tmp_path / "crash.ncu-rep", "ncu", timeout_s=120)


def test_run_ncu_without_ncu(monkeypatch):
    monkeypatch.setattr(nsight, "find_ncu", lambda: None)
    with pytest.raises(nsight.NcuError, match="ncu .* not found"):
        nsight.run_ncu("cpu-tiny", 1, 8, 40)


def _fake_ncu(tmp_path, body: str):
    script = tmp_path / "ncu"
    script.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_run_ncu_with_a_fake_cli(monkeypatch, tmp_path):
    # A stand-in ncu: writes the report it is asked for, prints the CSV on --import. The real
    # module reader is absent here, so this also checks the CSV fallback and the command line.
    csv_path = tmp_path / "out.csv"
    csv_path.write_text(WIDE_CSV)
    script = _fake_ncu(tmp_path, f'''
        import sys
        args = sys.argv[1:]
        if "--version" in args:
            print("NVIDIA (R) Nsight Compute Command Line Profiler\\nVersion 2025.3.1.0")
        elif "--import" in args:
            print(open({str(csv_path)!r}).read())
        else:
            assert "--clock-control" in args and args[args.index("--clock-control") + 1] == "none"
            assert args[args.index("--nvtx-include") + 1] == "autoopt_sample/"
            assert args[args.index("--launch-count") + 1] == "24"
            assert "autoopt.profiler.child" in args
            assert args[args.index("--ops") + 1] == "moe_experts,rmsnorm"
            open(args[args.index("-o") + 1] + ".ncu-rep", "w").write("rep")
    ''')
    monkeypatch.setenv("AUTOOPT_NCU", str(script))
    monkeypatch.delitem(sys.modules, "ncu_report", raising=False)
    monkeypatch.setattr(nsight, "_ncu_report_module",
                        lambda ncu: (_ for _ in ()).throw(ImportError("no ncu_report")))
    run = nsight.run_ncu("cpu-tiny", 1, 8, 40, out_dir=tmp_path / "rep", timeout_s=120,
                         ops=("moe_experts", "rmsnorm"), launch_count=24)
    assert run.version == "2025.3.1.0" and run.reader.startswith("csv")
    assert [r.op for r in run.records] == ["moe_experts", "rmsnorm"]


def test_run_ncu_failure_is_reported(monkeypatch, tmp_path):
    script = _fake_ncu(tmp_path, '''
        import sys
        print("==ERROR== Failed to initialize the profiler: LibraryNotLoaded")
        sys.exit(1)
    ''')
    monkeypatch.setenv("AUTOOPT_NCU", str(script))
    with pytest.raises(nsight.NcuError, match="LibraryNotLoaded"):
        nsight.run_ncu("cpu-tiny", 1, 8, 40, out_dir=tmp_path / "rep", timeout_s=120)


def test_the_nsight_sample_is_bounded_to_the_top_ops(monkeypatch):
    """Nsight Compute replays only the top ops' kernels of the fewest layers that hold every
    layer kind, at most `launch_count` of them; a failure is recorded, not raised."""
    from autoopt.profiler.attribution import OpRow, Profile
    from autoopt.targets import load_target

    rows = tuple(OpRow(op, 1, 1, t, 10.0, floor_us=1.0, gap_us=t - 1.0) for op, t in
                 (("moe_experts", 90.0), ("router", 50.0), ("rmsnorm", 9.0), ("swiglu", 5.0),
                  ("o_proj", 80.0)))
    p = Profile("cpu-tiny", "decode", 3, 40, 8, "reference", "torch", "", "NVIDIA H200", None,
                rows, 300.0, "", 234.0, 10.0, Rates(4e12, 8e14, 5e13, "test"),
                checks={"seed": 4})
    seen = []

    def fake_run(target, batch, layers, context, kernels, seed, **kw):
        seen.append(dict(target=target, batch=batch, layers=layers, seed=seed, **kw))
        if kw["ops"] == ("router",):
            raise nsight.NcuError("router's run failed")
        return nsight.NcuRun([KernelRecord(f"k_{kw['ops'][0]}", kw["ops"][0], 3.0, 6000)],
                             "2025.3.1", 9.0, "csv", "ncu ...")

    monkeypatch.setattr(nsight, "run_ncu", fake_run)
    out = nsight.sample_top_kernels(p, 24, timeout_s=90.0)
    # One run per top op (by gap), each with a third of the kernels and of the time: a single
    # run over all three stopped inside the first op's kernels.
    assert [s["ops"] for s in seen] == [("moe_experts",), ("router",), ("rmsnorm",)]
    assert all(s["launch_count"] == 8 and s["timeout_s"] == 30.0 and s["batch"] == 3
               and s["seed"] == 4 for s in seen)
    assert seen[0]["layers"] == nsight.sample_layers(load_target("cpu-tiny")) == 6
    sample = out.checks["ncu_sample"]
    assert sample["ops"] == ["moe_experts", "router", "rmsnorm"]
    assert [k["op"] for k in sample["kernels"]] == ["moe_experts", "rmsnorm"]
    assert sample["errors"] == {"router": "router's run failed"} and sample["wall_s"] == 18.0
    k = sample["kernels"][0]
    assert k["dram_bytes"] == 6000 and k["gb_s"] == pytest.approx(2.0)
    monkeypatch.setattr(nsight, "run_ncu", lambda *a, **k: (_ for _ in ()).throw(
        nsight.NcuError("no ncu")))
    assert nsight.sample_top_kernels(p, 24).checks["ncu_sample"]["error"] == "no ncu"


def test_run_ncu_timeout_ends_the_child(monkeypatch, tmp_path):
    script = _fake_ncu(tmp_path, '''
        import time
        time.sleep(60)
    ''')
    monkeypatch.setenv("AUTOOPT_NCU", str(script))
    start = __import__("time").perf_counter()
    with pytest.raises(nsight.NcuError, match="did not finish within 1 s"):
        nsight.run_ncu("cpu-tiny", 1, 8, 40, out_dir=tmp_path / "rep", timeout_s=1)
    assert __import__("time").perf_counter() - start < 30


def test_the_profiled_child_ranges_only_the_sampled_ops(monkeypatch, capsys):
    """The process ncu profiles (autoopt.profiler.child): after its warm-up, every call of the
    sampled ops, and nothing else, runs inside [autoopt_sample, <op>]."""
    import torch

    from autoopt.profiler import child

    stack, seen = [], []

    def push(name):
        stack.append(name)
        seen.append(tuple(stack))

    monkeypatch.setattr(torch.cuda.nvtx, "range_push", push)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: stack.pop())
    child.main(["--target", "cpu-tiny", "--batch", "2", "--layers", "6", "--ops",
                "moe_experts,rmsnorm"])
    assert "step done" in capsys.readouterr().out and stack == []
    inner = [s for s in seen if len(s) == 2]
    assert {s[1] for s in inner} == {"moe_experts", "rmsnorm"}
    assert all(s[0] == nsight.SAMPLE_RANGE for s in inner)
    assert [s[1] for s in inner].count("moe_experts") == 3  # layers 3-5 of 6 are MoE
