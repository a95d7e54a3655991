"""The evaluation farm: inline, a process per device, and Ray (a local cluster on loopback);
a lost worker's job retried elsewhere; the CuTe route; Nsight metrics read from ncu's CSV."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from autoopt.farm import EvalJob, FarmSpec
from autoopt.farm.local import InlineFarm, LocalFarm
from autoopt.farm.profile import format_profile, parse_csv

from .farm_support import DiesOnce, WhereJob

DATA = Path(__file__).parent / "data"


def test_farm_kind_follows_what_the_run_asked_for():
    assert FarmSpec(devices=("cpu",)).kind == "inline"
    assert FarmSpec(devices=("cuda:0", "cuda:1"), gpu=True).kind == "local"
    assert FarmSpec(devices=("cpu",), ray_address="local").kind == "ray"
    with pytest.raises(ValueError, match="devices or a Ray address"):
        FarmSpec(devices=())


def test_inline_farm_runs_jobs_in_this_process():
    import os

    with InlineFarm("cpu") as farm:
        res = farm.submit(WhereJob()).result()
    assert res["device"] == "cpu" and res["pid"] == os.getpid() and res["kind"] == "where"
    assert res["device_s"] >= 0 and res["worker"].endswith("/cpu")


@pytest.mark.slow
def test_local_farm_replaces_a_dead_worker_and_retries_its_job(tmp_path):
    import os

    with LocalFarm(["cpu", "cpu"]) as farm:
        futures = [farm.submit(WhereJob()) for _ in range(3)]
        lost = farm.submit(DiesOnce(str(tmp_path / "died")))
        where = [f.result(timeout=120) for f in futures]
        again = lost.result(timeout=120)
    assert {w["device"] for w in where} == {"cpu"} and os.getpid() not in {w["pid"]
                                                                           for w in where}
    assert all(w["interpret"] == "1" for w in where)  # CPU workers run the interpreter
    assert again["pid"] != again["killed_pid"] and farm.lost and "died" in farm.lost[0]


@pytest.fixture(scope="module")
def ray_farm():
    import importlib.util

    if importlib.util.find_spec("ray") is None:  # not imported here: the farm sets its env
        pytest.skip("ray is not installed (pip install -e '.[test]')")
    from autoopt.farm.ray_farm import RayFarm

    farm = RayFarm("local", gpu=False, num_cpus=2, max_retries=2)
    yield farm
    farm.close()


@pytest.mark.slow
def test_ray_local_cluster_is_loopback_only_and_retries_a_lost_worker(ray_farm, tmp_path):
    import ray

    assert ray_farm.workers == ["ray:cpu0", "ray:cpu1"]
    nodes = ray.nodes()
    assert [n["NodeManagerAddress"] for n in nodes] == ["127.0.0.1"]
    res = ray_farm.submit(DiesOnce(str(tmp_path / "died"), inner=WhereJob())).result(timeout=120)
    assert res["pid"] != res["killed_pid"]  # the task ran again on another worker process
    assert res["device"] == "cpu" and res["interpret"] == "1"


_CUTE = '''
LANGUAGE = "cute"
ARCHS = ("sm_90",)
import torch


def run(gate, up, config=None):
    raise NotImplementedError


def precompile(arch="sm_90a"):
    return ["nothing"]
'''


def test_cute_submissions_go_to_the_cute_compile_check_first(tmp_path, monkeypatch):
    """A CuTe DSL source is compiled by model.registry.cute.check_compiles for the worker's
    arch before the judge sees it; a compile error stops it there."""
    from model.registry import cute

    seen = []

    def check(path, arch="sm_90a", timeout=600.0):
        seen.append((Path(path).read_text(), arch))
        return [f"{path}: DSLRuntimeError: bad layout"]

    def no_judge(*a, **kw):
        raise AssertionError("the judge must not run a source that does not compile")

    monkeypatch.setattr(cute, "check_compiles", check)
    monkeypatch.setattr("autoopt.eval.verify.verify_variant", no_judge)
    monkeypatch.setattr("model.registry.current_arch", lambda device: "sm_90")
    job = EvalJob(op="swiglu", name="a01_cute", source=_CUTE, language="cute")
    res = job.run("cuda:0")
    assert seen == [(_CUTE, "sm_90")]
    assert res["stage"] == "compile" and "bad layout" in res["reasons"][0]
    assert "sm_90a" in res["reasons"][0]
    # A Triton source never goes there.
    from autoopt.farm.languages import precheck

    assert precheck("triton", tmp_path / "x.py", "cuda:0") == [] and len(seen) == 1
    assert "cannot be submitted" in precheck("library", tmp_path / "x.py", "cpu")[0]


@pytest.mark.slow
def test_a_cute_source_compiles_on_cpu_and_is_never_run_there(tmp_path):
    from model.registry import cute

    if cute.unavailable():
        pytest.skip(cute.unavailable())
    res = EvalJob(op="swiglu", name="a01_cute", source=textwrap.dedent(_CUTE),
                  language="cute").run("cpu")
    assert res["stage"] == "compile" and len(res["reasons"]) == 1
    assert res["reasons"][0].startswith("compiles for sm_90a, but not verified")
    assert "NVIDIA GPUs only" in res["reasons"][0]


def test_nsight_metrics_from_ncu_csv(tmp_path):
    """`ncu --import --csv --page raw --print-units base` of a candidate's kernels, read and
    formatted for the agent (the fixture is in ncu's raw-page layout; the GPU script
    benchmarks/agents_gpu.py records a real one)."""
    text = (DATA / "ncu_candidate_raw.csv").read_text()
    kernels = parse_csv(text)
    assert [k["name"] for k in kernels] == ["_router_gemv_kernel", "_router_select_kernel"]
    k = kernels[0]
    assert k["bucket"] == "T=1" and kernels[1]["bucket"] == "T=8"
    assert k["duration_us"] == pytest.approx(6.112)
    assert k["dram_bytes"] == 10_518_528 + 2_560 and k["dram_read_bytes"] == 10_518_528
    assert k["dram_gb_s"] == pytest.approx((10_518_528 + 2_560) / 6112)
    assert (k["registers"], k["smem_per_block"], k["block"], k["grid"]) == (40, 1024, 128, 132)
    assert k["occupancy_pct"] == pytest.approx(22.48) and k["l2_hit_pct"] == pytest.approx(3.17)
    assert [s["reason"] for s in k["stalls"]] == ["long_scoreboard", "wait", "barrier"]
    assert kernels[1]["smem_per_block"] == 2048  # static shared memory counts too
    text = format_profile({"kernels": kernels, "ceiling_gb_s": 4000.0, "ncu": "2025.3.1",
                           "launch_count": 24})
    assert "_router_gemv_kernel [T=1]: 6.11 us, grid 132 x block 128" in text
    assert "1721 GB/s = 43% of the measured ceiling (36% of ncu's peak)" in text
    assert "occupancy 22.5% achieved, 40 registers/thread, 1,024 B shared/block" in text
    assert "top stalls (cycles per issued instruction): long_scoreboard 18.42" in text
    # The details page (one row per metric) reads the same.
    long = ['"ID","Kernel Name","Section Name","Metric Name","Metric Unit","Metric Value"',
            '"0","k","Command line profiler metrics","gpu__time_duration.sum","usecond","2.5"',
            '"0","k","Command line profiler metrics","launch__registers_per_thread",'
            '"register/thread","64"']
    (one,) = parse_csv("\n".join(long))
    assert one["duration_us"] == pytest.approx(2.5) and one["registers"] == 64


def test_profile_on_a_cpu_worker_is_a_plain_message(tmp_path):
    from autoopt.farm import ProfileJob

    res = ProfileJob(op="swiglu", name="p", source="x = 1\n", shapes=({"T": 1, "I": 8},)
                     ).run("cpu")
    assert "no GPU" in res["message"] and format_profile(res) == res["message"]


@pytest.mark.gpu
def test_profile_candidate_on_a_gpu_reads_ncu_metrics():
    from autoopt.agents.template import CATALOG
    from autoopt.farm import ProfileJob
    from autoopt.profiler.nsight import find_ncu

    if find_ncu() is None:
        pytest.skip("ncu is not installed on this GPU machine")
    spec = CATALOG["swiglu"][0]
    shapes = ({"T": 1, "I": 2560}, {"T": 64, "I": 2560})
    res = ProfileJob(op="swiglu", name="swiglu_tiles", source=spec.render(), shapes=shapes,
                     per_bucket={"T=1": spec.default(), "T=64": spec.default()}).run("cuda:0")
    assert "kernels" in res, res.get("message")
    assert {k["bucket"] for k in res["kernels"]} <= {"T=1", "T=64", None}
    for k in res["kernels"]:
        assert k["duration_us"] > 0 and k["registers"] > 0 and k["block"] > 0
        assert k["dram_bytes"] and k["dram_bytes"] > 0 and k["occupancy_pct"] is not None
    assert res["ceiling_gb_s"] > 1000  # an H200 copies at a few TB/s
    assert "of the measured ceiling" in format_profile(res)


def test_an_eval_job_keeps_its_timing_inside_its_time_limit(monkeypatch):
    # The job's budget is the op's deadline: on an H200 a template candidate verified near it was
    # then timed (candidate and baseline, eight buckets) for 72 s more, each stage under the full
    # limit again. Now timing gets only what verification left; a verified candidate without
    # time for it comes back untimed. Without a budget each stage keeps its own limit.
    import time

    import autoopt.eval.bench as bench
    from autoopt.farm import jobs

    monkeypatch.setattr(jobs.EvalJob, "_verify",
                        lambda self, path, device, end: ([], [{}], None))
    timed = []

    def fake_bench(op, path, shapes, device, *, timeout_s, **kw):
        timed.append(timeout_s)
        return []

    monkeypatch.setattr(bench, "bench_op", fake_bench)
    shapes = ({"T": 1, "H": 64},)

    def job(**kw):
        return EvalJob(op="swiglu", name="a01_x", source="", timed=True, bench_shapes=shapes,
                       **kw)

    res = job(budget_s=jobs.MIN_STAGE_S - 1).run("cpu")
    assert res["stage"] == "verify" and res["rows"] == [] and "not timed" in res["untimed"]
    assert timed == []
    res = job(budget_s=60, timeout_s=300).run("cpu")
    assert res["stage"] == "bench" and "untimed" not in res
    assert len(timed) == 1 and 0 < timed[0] <= 60  # what was left of the job, not 300
    res = job(timeout_s=300).run("cpu")  # no deadline: each stage its own limit
    assert res["stage"] == "bench" and timed[-1] == 300

    def slow_bench(op, path, shapes, device, *, timeout_s, **kw):
        time.sleep(timeout_s + 0.05)  # the worker's budget ends the timing
        raise RuntimeError("benchmark of swiglu failed in its worker: budget spent")

    monkeypatch.setattr(bench, "bench_op", slow_bench)
    monkeypatch.setattr(jobs, "MIN_STAGE_S", 0.2)
    res = job(budget_s=0.5).run("cpu")
    assert "ran past the job's" in res["untimed"] and res["rows"] == []
    with pytest.raises(RuntimeError, match="budget spent"):  # no deadline: a real failure
        job(timeout_s=0.3).run("cpu")


def test_a_verification_the_deadline_cuts_short_is_unjudged_not_rejected(monkeypatch):
    # On an H200 an op's deadline ended a template candidate's verification 43 s into it, and
    # the run recorded "timeout ... the candidate hung or was too slow" as a rejection. A timeout
    # under a limit the deadline cut is the deadline's: unjudged. Under its own full limit it is
    # the candidate's: rejected. Any other failure is the candidate's whatever the limit.
    import time
    from types import SimpleNamespace

    import autoopt.eval.verify as verify
    from autoopt.farm import jobs

    def fake_verify(reasons, sleep=True):
        def run(op, path, *, timeout_s, **kw):
            if sleep:
                time.sleep(timeout_s)
            return SimpleNamespace(passed=not reasons, reasons=list(reasons),
                                   to_dict=lambda: {"reasons": list(reasons)})
        return run

    def job(**kw):
        return EvalJob(op="swiglu", name="a01_x", source="", timed=True,
                       bench_shapes=({"T": 1, "H": 64},), configs=({"B": 1}, {"B": 2}), **kw)

    monkeypatch.setattr(jobs, "MIN_STAGE_S", 0.2)
    hung = ["timeout after 0.5 s (the candidate hung or was too slow; worker killed)"]
    monkeypatch.setattr(verify, "verify_variant", fake_verify(hung))
    res = job(budget_s=0.5, timeout_s=300).run("cpu")
    assert res["reasons"] == [] and "not judged" in res["unjudged"], res
    assert "ran out with config {'B': 1}" in res["unjudged"] and res["rows"] == []
    res = job(budget_s=None, timeout_s=0.3).run("cpu")  # its own limit: the candidate's fault
    assert "unjudged" not in res and res["reasons"] and "hung" in res["reasons"][0]
    monkeypatch.setattr(verify, "verify_variant",
                        fake_verify(["mismatch at T=1: 3 of 64 outputs"], sleep=False))
    res = job(budget_s=0.5, timeout_s=300).run("cpu")
    assert "unjudged" not in res and "mismatch" in res["reasons"][0]


def test_a_proposal_with_a_config_per_bucket_is_verified_once_as_served(monkeypatch):
    # On an H200 a template's three bucket configs took three whole verifications (~50 s each):
    # one verification now gives every call the config serving would give it.
    from types import SimpleNamespace

    import autoopt.eval.verify as verify
    from autoopt.eval.run import PerBucket

    seen = []

    def fake(op, path, *, config, **kw):
        seen.append(config)
        return SimpleNamespace(passed=True, reasons=[], to_dict=lambda: {"verdict": "pass"})

    monkeypatch.setattr(verify, "verify_variant", fake)
    a, b = {"ROWS": 1}, {"ROWS": 4}
    job = EvalJob(op="swiglu", name="a01_tiles", source="", timed=False, configs=(a, b),
                  per_bucket={"T=1": a, "T=8": b, "T=64": b})
    res = job.run("cpu")
    assert res["reasons"] == [] and len(seen) == 1 and isinstance(seen[0], PerBucket)
    assert seen[0].describe() == {"T=1": a, "T=8": b, "T=64": b} and seen[0].single() is None
    # One tuned config for every bucket: still the table at the target's widths (from the
    # bench shapes), so the default is judged at the others; no config at all: the plain path.
    seen.clear()
    shapes = ({"T": 1, "I": 320}, {"T": 8, "I": 320})
    EvalJob(op="swiglu", name="a01_tiles", source="", timed=False, configs=(a,),
            per_bucket={"T=1": a, "T=8": a}, bench_shapes=shapes).run("cpu")
    assert isinstance(seen[0], PerBucket) and seen[0].served == ((320,),)
    assert seen[0].single() == a  # the report names it as its config, the table beside it
    EvalJob(op="swiglu", name="a01_tiles", source="", timed=False, configs=(None,),
            per_bucket={"T=1": None, "T=8": None}, bench_shapes=shapes).run("cpu")
    assert seen[1] is None
    # A config the buckets do not cover (or an op without a token axis) keeps one each.
    seen.clear()
    job = EvalJob(op="swiglu", name="a01_tiles", source="", timed=False,
                  configs=(a, b, {"ROWS": 9}), per_bucket={"T=1": a, "T=8": b})
    job.run("cpu")
    assert seen == [a, b, {"ROWS": 9}]


def test_servers_with_unix_sockets_get_a_short_temp_dir_under_a_long_tmpdir(monkeypatch):
    # Ray's session sockets and Chromium's singleton lie tens of characters below the temp dir;
    # past 107 bytes a Unix socket cannot be made and they abort at start.
    import shutil
    import tempfile

    from autoopt import env
    from autoopt.farm.ray_farm import RAY_SOCKET_SUFFIX

    monkeypatch.setattr(tempfile, "gettempdir", lambda: "/tmp")
    assert env.socket_safe_tmpdir(RAY_SOCKET_SUFFIX) is None
    monkeypatch.setattr(tempfile, "gettempdir", lambda: "/tmp/" + "x" * 60)
    short = env.socket_safe_tmpdir(RAY_SOCKET_SUFFIX)
    try:
        assert short and Path(short).is_dir() and short.startswith("/tmp/")
        assert len(short) + RAY_SOCKET_SUFFIX <= env.AF_UNIX_PATH_MAX
    finally:
        shutil.rmtree(short, ignore_errors=True)
