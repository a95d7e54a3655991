"""The worker process and its audit hook, driven directly (these candidates bypass the static
screen on purpose, to test the defences behind it): what the worker holds, what the hook refuses,
timeouts, crashes, its environment; and verify's handling of import failures."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest
import torch

from autoopt.eval import audit
from autoopt.eval.channel import Worker, WorkerError
from autoopt.eval.plan import Secret
from autoopt.eval.run import POISON_DTYPES, start_candidate
from autoopt.eval.verify import verify_variant


def _call(source: str, timeout: float = 90.0, env: dict | None = None,
          monkeypatch=None) -> dict:
    """Load `source` in a fresh worker and call its run(x) once; the worker's reply."""
    s = Secret()
    with Worker("cpu", budget_s=timeout) as w:
        palettes = {dt: s.palette(dt) for dt in POISON_DTYPES}
        err = start_candidate(w, textwrap.dedent(source).encode(), "cpu", None, palettes, 1)
        assert err is None, err
        w.request({"cmd": "put", "handle": 1, "args": w.pack([torch.ones(2, 3)])})
        reply = w.request({"cmd": "call", "handle": 1, "out": 1,
                           "expect": [{"dtype": "float32", "shape": [2, 3]}],
                           "region": {"off": 0, "cap": w.arena.size}})
        reply["blocked_now"] = w.request({"cmd": "ping"})["blocked"]
        return reply


HOSTILE = '''
import os
import socket
import subprocess


def run(x, config=None):
    done = []
    for name, act in [
        ("subprocess", lambda: subprocess.run(["true"])),
        ("socket", lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM)),
        ("write", lambda: open(os.environ.get("HOME", "/") + "/autoopt-worker-test", "w")),
        ("read_proc", lambda: open("/proc/self/environ").read()),
        ("read_parent", lambda: open(f"/proc/{os.getppid()}/mem", "rb")),
        ("remove", lambda: os.remove("/nonexistent-autoopt")),
        ("system", lambda: os.system("true")),
        ("kill", lambda: os.kill(os.getppid(), 0)),
        ("import", lambda: __import__("sqlite3")),
        ("exec", lambda: exec("1")),
    ]:
        try:
            act()
            done.append(name)
        except PermissionError:
            pass
        except OSError:
            done.append(name + "?")
    raise RuntimeError("done=" + ",".join(done))
'''


def test_audit_hook_blocks_candidate_side_effects():
    reply = _call(HOSTILE)
    assert reply["raised"] == "RuntimeError: done="  # nothing got through
    events = " ".join(reply["blocked_now"])
    for ev in ("subprocess.Popen", "socket.", "open", "os.remove", "os.system", "os.kill",
               "import ('sqlite3'", "compile"):
        assert ev in events, reply["blocked_now"]


def test_frames_and_gc_are_refused_even_with_sys_in_hand():
    reply = _call('''
        import sys


        def run(x, config=None):
            got = []
            for name, act in [("frame", lambda: sys._getframe(1)),
                              ("gc", lambda: __import__("gc").get_objects()),
                              ("trace", lambda: sys.settrace(None))]:
                try:
                    act()
                    got.append(name)
                except PermissionError:
                    pass
            sys.addaudithook(lambda *a: None)  # refused: CPython then adds nothing, silently
            raise RuntimeError("got=" + ",".join(got))
    ''')
    assert reply["raised"] == "RuntimeError: got="
    assert any(b.startswith("sys.addaudithook") for b in reply["blocked_now"])


def test_the_worker_holds_no_judge_code():
    # What a candidate that got `sys` anyway would find: the runner, its wire and audit modules,
    # and no reference, plan, secret or judgement; the repository is off sys.path.
    reply = _call('''
        import sys


        def run(x, config=None):
            mods = sorted(m for m in sys.modules if m.split(".")[0] in ("model", "autoopt"))
            raise RuntimeError(";".join(mods) + "|" + str(any("judge" in p for p in sys.path)))
    ''')
    mods, on_path = reply["raised"].removeprefix("RuntimeError: ").split("|")
    assert set(mods.split(";")) <= {"autoopt", "autoopt.eval", "autoopt.eval.worker",
                                    "autoopt.eval.worker_burst", "autoopt.eval.worker_state",
                                    "autoopt.eval.wire",
                                    "autoopt.eval.audit"}
    assert on_path == "False"


def test_audit_state_lives_in_a_closure_only():
    # No module-level mutable state to clear: the hook's state is in its closure.
    tree = ast.parse(Path(audit.__file__).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            value = node.value
            assert not isinstance(value, ast.Dict | ast.List | ast.Set | ast.Call), \
                ast.unparse(node)


def test_worker_environment(monkeypatch):
    monkeypatch.setenv("FAKE_API_KEY", "secret")
    monkeypatch.setenv("AUTOOPT_REGISTRY", "/somewhere")
    monkeypatch.setenv("MALLOC_PERTURB_", "128")
    reply = _call('''
        import os


        def run(x, config=None):
            names = ("FAKE_API_KEY", "AUTOOPT_REGISTRY", "MALLOC_PERTURB_")
            keys = [k for k in names if k in os.environ]
            raise RuntimeError(",".join(keys) + "|" + os.environ.get("TRITON_INTERPRET", ""))
    ''')
    assert reply["raised"] == "RuntimeError: |1"  # no credentials, no recognisable poison


def test_timeout_kills_the_worker():
    with pytest.raises(WorkerError, match="timeout after") as e:
        _call("def run(x, config=None):\n    while True:\n        pass\n", timeout=15)
    assert e.value.kind == "timeout"


def test_a_deep_temp_dir_still_holds_the_workers_socket(tmp_path, monkeypatch):
    # An AF_UNIX name holds 107 bytes; CI runners and macOS hand out temp dirs near that.
    import tempfile

    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    reply = _call("def run(x, config=None):\n    return x * 2\n")
    assert not reply.get("raised"), reply


def test_a_crashing_worker_is_reported():
    with pytest.raises(WorkerError, match="worker died") as e:
        _call("import os\n\ndef run(x, config=None):\n    os._exit(3)\n")
    assert e.value.kind == "died" and "exit code 3" in str(e.value)


def test_import_error_is_a_rejection(tmp_path):
    src = tmp_path / "broken.py"
    src.write_text("import torch\n\nX = 1 / 0\n\ndef run(g, u, config=None):\n    return g\n")
    rep = verify_variant("swiglu", src, shapes=[{"T": 3, "I": 8}], timeout_s=120)
    assert rep.verdict == "reject"
    assert rep.reasons == ["import failed: ZeroDivisionError: division by zero"]


def test_unknown_op_and_missing_file_raise(tmp_path):
    with pytest.raises(ValueError, match="unknown op"):
        verify_variant("nope", tmp_path / "x.py")
    with pytest.raises(FileNotFoundError):
        verify_variant("swiglu", tmp_path / "missing.py")


def test_racecheck_summary_is_parsed():
    from autoopt.eval.races import is_kernel_language, parse_summary

    log = ("========= COMPUTE-SANITIZER\n========= Error: Race reported between Write access at "
           "0x1f0 in kernel and Read access\n"
           "========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)\n")
    assert parse_summary(log) == {"hazards": 2, "errors": 1, "warnings": 1}
    clean = "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"
    assert parse_summary(clean) == {"hazards": 0, "errors": 0, "warnings": 0}
    assert parse_summary("no summary here") == {}
    assert is_kernel_language(b"import triton\n") and is_kernel_language(b"import cutlass.cute")
    assert not is_kernel_language(b"import torch\n")


LIBRARY_RACE = (
    "========= Error: Race reported between Write access at nvjet_sm90_tst_64x8_splitK_TNT+0x2e10\n"
    "=========     and Write access at nvjet_sm90_tst_64x8_splitK_TNT+0x2f60 [336 hazards]\n")
OWN_RACE = (
    "========= Error: Race reported between Write access at _gemv_kernel+0x1a0\n"
    "=========     and Read access at _gemv_kernel+0x2b0 [12 hazards]\n")


def _summary(errors: int) -> str:
    return (f"========= RACECHECK SUMMARY: {errors} hazards displayed ({errors} errors, "
            "0 warnings)\n")


@pytest.mark.parametrize("log,names,counted,library", [
    # Only the library's kernel (the variant called cuBLAS, as the reference does): excused.
    # ("split" is inside the library's symbol, but not as a whole word.)
    (LIBRARY_RACE + _summary(1), {"_gemv_kernel", "run", "split"}, 0,
     ["nvjet_sm90_tst_64x8_splitK_TNT"]),
    # The candidate's own kernel: counted, beside an excused library record.
    (OWN_RACE + LIBRARY_RACE + _summary(2), {"_gemv_kernel"}, 1,
     ["nvjet_sm90_tst_64x8_splitK_TNT"]),
    # A kernel named like the library's is still the candidate's when its source defines it.
    (LIBRARY_RACE + _summary(1), {"nvjet_sm90_tst_64x8_splitK_TNT"}, 1, []),
    (LIBRARY_RACE + _summary(1), {"tst"}, 1, []),  # a whole word of it: counted (conservative)
    # A record naming no kernel, and records past the print limit, count.
    ("========= Error: Race reported between Write access and Read access\n" + _summary(1),
     set(), 1, []),
    (LIBRARY_RACE + _summary(3), {"_gemv_kernel"}, 2, ["nvjet_sm90_tst_64x8_splitK_TNT"]),
])
def test_racecheck_hazards_are_attributed_to_the_candidate_or_the_library(log, names, counted,
                                                                           library):
    from autoopt.eval.races import candidate_errors, defined_names, parse_summary

    assert candidate_errors(log, parse_summary(log), names) == (counted, library)
    assert defined_names(b"import triton\n@triton.jit\ndef _k(x):\n    pass\n"
                         b"def run(a):\n    def inner():\n        pass\n") == {"_k", "run",
                                                                             "inner"}


def test_cpu_reports_races_not_checked(tmp_path):
    src = tmp_path / "plain.py"
    src.write_text("import torch.nn.functional as F\n\n\ndef run(gate, up, config=None):\n"
                   "    return (F.silu(gate.float()) * up.float()).to(gate.dtype)\n")
    from autoopt.eval.plan import Budget

    rep = verify_variant("swiglu", src, budget=Budget(seeds=1, max_tokens=24), timeout_s=120)
    assert rep.verdict == "pass", rep.reasons
    assert rep.checks["races"]["racecheck"] == "not checked (no GPU)"
    # Where the trials' time went, kind by kind: each part of the whole, all of it measured.
    spent = rep.checks["judge_time_s"]
    assert set(spent) == {"trials", "inputs", "reference", "near_misses", "transfers", "calls",
                          "by_step"}
    parts = [spent[k] for k in spent if k not in ("trials", "by_step")]
    assert all(v >= 0 for v in parts) and spent["calls"] > 0 and spent["transfers"] > 0
    assert spent["reference"] > 0 and sum(parts) <= spent["trials"] + 0.05
    # And step kind by step kind, largest first: together they are the trials' wall time.
    steps = spent["by_step"]
    assert {"first", "repeat"} <= set(steps) and list(steps.values()) == sorted(
        steps.values(), reverse=True)
    assert sum(steps.values()) == pytest.approx(spent["trials"], abs=0.05 + 0.01 * len(steps))


FAKE_SANITIZER = '''#!/usr/bin/env bash
# Stands in for compute-sanitizer: runs the command, then writes a racecheck summary.
log=""; args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --log-file) log="$2"; shift 2;;
    --tool|--print-limit) shift 2;;
    *) args+=("$1"); shift;;
  esac
done
"${args[@]}"; rc=$?
echo "========= Error: Race reported between Write access and Read access" >> "$log"
echo "========= RACECHECK SUMMARY: ERRORS hazards displayed (ERRORS errors, 0 warnings)" >> "$log"
exit $rc
'''


def _under_fake_sanitizer(tmp_path, monkeypatch, script: str, check: str) -> dict:
    """races.<check> on the honest Triton swiglu, with `script` standing in for
    compute-sanitizer."""
    from autoopt.eval import races
    from autoopt.eval.plan import Budget, default_targets, plan_shapes
    from model.ops import contract

    fake = tmp_path / "compute-sanitizer"
    fake.write_text(script)
    fake.chmod(0o755)
    monkeypatch.setattr(races, "sanitizer_path", lambda: str(fake))
    text = (Path(__file__).parent / "adversarial" / "honest_triton_swiglu.py").read_bytes()
    c, s = contract("swiglu"), Secret()
    plan = plan_shapes(c, "cpu", default_targets("cpu"), None, Budget(), s)
    return getattr(races, check)(c, text, plan, s, None, "cpu")


@pytest.mark.parametrize("errors,status", [(0, "passed"), (2, "races found")])
def test_racecheck_runs_the_worker_under_the_sanitizer(tmp_path, monkeypatch, errors, status):
    script = FAKE_SANITIZER.replace("ERRORS", str(errors))
    out = _under_fake_sanitizer(tmp_path, monkeypatch, script, "gpu_racecheck")
    assert out["status"] == status, out
    assert out["summary"]["errors"] == errors
    assert ("reason" in out) == bool(errors)
    assert len(out["shapes"]) <= 2  # the smallest bucket and the smallest with T >= 2


FAKE_MEMCHECK = '''#!/usr/bin/env bash
# Stands in for compute-sanitizer --tool memcheck: runs the command, then writes its summary.
log=""; args=(); flags=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --log-file) log="$2"; shift 2;;
    --tool|--print-limit|--report-api-errors) flags="$flags $1 $2"; shift 2;;
    *) args+=("$1"); shift;;
  esac
done
"${args[@]}"; rc=$?
echo "========= flags:$flags caching-off:${PYTORCH_NO_CUDA_MEMORY_CACHING:-unset}" >> "$log"
if [ ERRORS -gt 0 ]; then
  echo "========= Invalid __global__ write of size 2 bytes" >> "$log"
fi
echo "========= ERROR SUMMARY: ERRORS errors" >> "$log"
exit $rc
'''


@pytest.mark.parametrize("errors,status", [(0, "passed"), (3, "errors found")])
def test_memcheck_runs_the_worker_under_the_sanitizer_without_the_caching_allocator(
        tmp_path, monkeypatch, errors, status):
    script = FAKE_MEMCHECK.replace("ERRORS", str(errors))
    out = _under_fake_sanitizer(tmp_path, monkeypatch, script, "gpu_memcheck")
    assert out["status"] == status, out
    assert out["errors"] == errors
    assert "--tool memcheck" in out["log_tail"] and "--report-api-errors no" in out["log_tail"]
    assert "caching-off:1" in out["log_tail"]  # every tensor its own allocation
    # ...and the smallest drawn shape too (a secret token count; on CPU drawn widths as well)
    assert len(out["shapes"]) == 3, out["shapes"]
    assert ("reason" in out) == bool(errors)
    if errors:
        assert "memcheck found 3 errors" in out["reason"] and "Invalid __global__" in out["reason"]


FAKE_MEMCHECK_KILLS = '''#!/usr/bin/env bash
# Stands in for memcheck stopping a kernel at an invalid write: the log has the finding, and the
# worker dies before it answers.
log=""
while [[ $# -gt 0 ]]; do
  case "$1" in --log-file) log="$2"; shift 2;; *) shift;; esac
done
echo "========= Invalid __global__ write of size 2 bytes" >> "$log"
echo "=========     at _swiglu_fwd_kernel+0x1a0" >> "$log"
exit 1
'''


def test_memcheck_findings_count_when_the_worker_dies_of_them(tmp_path, monkeypatch):
    out = _under_fake_sanitizer(tmp_path, monkeypatch, FAKE_MEMCHECK_KILLS, "gpu_memcheck")
    assert out["status"] == "errors found" and out["errors"] == 1, out
    assert out["reason"].startswith("memcheck: compute-sanitizer memcheck found 1 errors")
    assert "the worker failed after them" in out["reason"]


def test_a_sanitizer_run_that_dies_without_findings_is_not_a_pass(tmp_path, monkeypatch):
    script = FAKE_MEMCHECK_KILLS.replace("Invalid __global__ write of size 2 bytes", "stopped")
    out = _under_fake_sanitizer(tmp_path, monkeypatch, script, "gpu_memcheck")
    assert out["status"] == "not checked" and "failed" in out["reason"], out


def test_memcheck_without_a_summary_is_not_a_pass():
    from autoopt.eval.races import parse_memcheck

    assert parse_memcheck("========= ERROR SUMMARY: 0 errors\n") == 0
    assert parse_memcheck("a\n========= ERROR SUMMARY: 1 error\n") == 1
    assert parse_memcheck("the worker died before the summary") is None


def test_memcheck_is_asked_for_and_runs_only_where_it_can_see_something(monkeypatch):
    from autoopt.eval import races, run

    called = []
    monkeypatch.setattr(races, "gpu_memcheck", lambda *a: called.append(a) or {"status": "x"})
    triton_text = b"import triton\n"
    assert run._memcheck(None, triton_text, None, None, None, "cpu", False, 60)["status"] \
        .startswith("not checked (no GPU")
    assert run._memcheck(None, b"import torch\n", None, None, None, "cuda", False, 60)["status"] \
        .startswith("not needed")
    assert run._memcheck(None, triton_text, None, None, None, "cuda", True, 60)["status"] \
        .startswith("not run")
    assert not called
    assert run._memcheck(None, triton_text, None, None, None, "cuda", False, 60) == {"status": "x"}
    assert len(called) == 1


def test_a_worker_ends_with_its_judge_even_in_a_call(tmp_path):
    # The worker runs in its own session, so killing the judge's process group leaves it: it
    # must notice its judge's end of the socket closing and exit, even mid-call (on a GPU an
    # orphan would keep the memory of the candidate it was judging).
    import os
    import signal
    import subprocess
    import sys
    import time

    judge = tmp_path / "judge.py"
    judge.write_text(textwrap.dedent('''
        import sys, torch
        from autoopt.eval.channel import Worker
        from autoopt.eval.plan import Secret
        from autoopt.eval.run import POISON_DTYPES, start_candidate
        s = Secret()
        w = Worker("cpu", budget_s=300)
        w.start()
        src = b"import time\\n\\ndef run(x, config=None):\\n    time.sleep(120)\\n    return x\\n"
        err = start_candidate(w, src, "cpu", None, {d: s.palette(d) for d in POISON_DTYPES}, 1)
        assert err is None, err
        w.request({"cmd": "put", "handle": 1, "args": w.pack([torch.ones(2, 3)])})
        print(w.proc.pid, flush=True)
        w.request({"cmd": "call", "handle": 1, "out": 1,
                   "expect": [{"dtype": "float32", "shape": [2, 3]}],
                   "region": {"off": 0, "cap": w.arena.size}}, timeout=200)
    '''))
    root = Path(__file__).resolve().parents[1]
    p = subprocess.Popen([sys.executable, str(judge)], cwd=root, stdout=subprocess.PIPE,
                         text=True, env={**os.environ, "PYTHONPATH": str(root)})
    try:
        pid = int(p.stdout.readline())
        time.sleep(1.0)  # the call is under way: the candidate sleeps inside it
        os.kill(pid, 0)  # the worker is alive
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            with open(f"/proc/{pid}/stat") as f:  # a zombie has exited (its parent is gone)
                if f.read().split(") ")[1].startswith("Z"):
                    break
            time.sleep(0.2)
        else:
            os.kill(pid, signal.SIGKILL)
            raise AssertionError("the worker outlived its judge by 20 s")
    finally:
        p.kill()


@pytest.mark.parametrize("pad,offset", [(3, 0), (64, 5), (320, 320)])
def test_the_gaps_between_a_padded_views_rows_hold_data(monkeypatch, pad, offset):
    # torch's CPU BF16 linear reads the gap after each row of a padded view and multiplies it by
    # zero: a NaN left there by the allocator made the reference fail its own verification.
    from autoopt.eval import worker

    t = torch.randn(5, 320, dtype=torch.bfloat16)
    state = worker._State("cpu")
    state.arena = type("Arena", (), {"size": 0, "view": staticmethod(lambda desc: t)})()
    monkeypatch.setattr(worker.wire.TensorDesc, "parse", staticmethod(lambda d, size: d))
    full = torch.full

    def nan_filled(*size, dtype=None, device=None):  # an allocator that left NaNs behind
        size = size[0] if len(size) == 1 and isinstance(size[0], tuple) else size
        return full(tuple(size), float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(torch, "empty", nan_filled)
    out = worker._materialize(state, {"pad": pad, "offset": offset})
    monkeypatch.undo()
    assert torch.equal(out, t) and out.stride(0) == 320 + pad
    base = torch.as_strided(out, (out.storage_offset() + 5 * (320 + pad),), (1,), 0)
    assert torch.isfinite(base.float()).all()
    w = torch.randn(7, 320, dtype=torch.bfloat16)
    assert torch.equal(torch.nn.functional.linear(out, w), torch.nn.functional.linear(t, w))


def test_the_worker_passes_default_config_as_serving_does_a_fresh_copy_each_call():
    # The registry calls a variant without a tuned config for the call with its DEFAULT_CONFIG,
    # a fresh copy each time: a verifier that passed None could be told apart by it, and one
    # dict shared by every call could count them.
    source = b"""
DEFAULT_CONFIG = {"SCALE": 3}


def run(x, config=None):
    if config is None:
        return x * 0
    config["calls"] = config.get("calls", 0) + 1
    return x * config["SCALE"] + config["calls"]
"""
    s = Secret()
    expect = [{"dtype": "float32", "shape": [2, 3]}]
    with Worker("cpu", budget_s=90) as w:
        palettes = {dt: s.palette(dt) for dt in POISON_DTYPES}
        assert start_candidate(w, source, "cpu", None, palettes, 1) is None
        w.request({"cmd": "put", "handle": 1, "args": w.pack([torch.ones(2, 3)])})
        for out in (1, 2):
            reply = w.request({"cmd": "call", "handle": 1, "out": out, "expect": expect,
                               "region": {"off": 0, "cap": w.arena.size}})
            (got,) = w.unpack(reply["data"], expect)
            assert torch.equal(got, torch.full((2, 3), 4.0)), (out, got)  # 1 * 3 + 1 each call
    with Worker("cpu", budget_s=90) as w:  # a config the judge names is the one passed
        assert start_candidate(w, source, "cpu", {"SCALE": 5}, palettes, 1) is None
        w.request({"cmd": "put", "handle": 1, "args": w.pack([torch.ones(2, 3)])})
        reply = w.request({"cmd": "call", "handle": 1, "out": 1, "expect": expect,
                           "region": {"off": 0, "cap": w.arena.size}})
        assert torch.equal(w.unpack(reply["data"], expect)[0], torch.full((2, 3), 6.0))
    with Worker("cpu", budget_s=90) as w:
        err = start_candidate(w, b"DEFAULT_CONFIG = 7\n\ndef run(x, config=None):\n    return x\n",
                              "cpu", None, palettes, 1)
        assert err and "DEFAULT_CONFIG is not a mapping" in err


# ---- a config per bucket, picked call by call as serving picks it ------------------------------
_BUCKETS = {"T=1": {"TAG": 1}, "T=8": {"TAG": 8}, "T=64": {"TAG": 64}}


def _tagged_variant(tmp_path, expected: str) -> Path:
    """A correct swiglu that raises unless the config it gets is `expected(T)`'s."""
    src = tmp_path / "tagged.py"
    src.write_text(textwrap.dedent(f'''
        import torch.nn.functional as F

        DEFAULT_CONFIG = {{"TAG": 0}}


        def run(gate, up, config=None):
            t = gate.shape[0]
            want = {expected}
            if config != {{"TAG": want}}:
                raise ValueError(f"T={{t}} got {{config}}, wanted TAG {{want}}")
            config["TAG"] = -1  # a variant that edits its config changes no later call
            return (F.silu(gate.float()) * up.float()).to(gate.dtype)
    '''))
    return src


def test_a_config_per_bucket_is_picked_per_call_by_the_registrys_rule(tmp_path):
    from autoopt.eval.plan import Budget
    from autoopt.eval.run import PerBucket

    per = PerBucket.of("swiglu", _BUCKETS)
    assert per is not None and per.table[0] == (1, {"TAG": 1})
    # The nearest bucket in log2, the smaller on a tie: 1-2 -> 1, 3-22 -> 8, 23+ -> 64.
    rule = "1 if t <= 2 else 8 if t <= 22 else 64"
    rep = verify_variant("swiglu", _tagged_variant(tmp_path, rule), config=per,
                         budget=Budget(seeds=1, max_tokens=40), timeout_s=120)
    assert rep.verdict == "pass", rep.reasons
    assert rep.config is None and rep.configs == _BUCKETS
    wrong = "8 if t <= 2 else 1"  # a candidate that expected another mapping fails loudly
    rep = verify_variant("swiglu", _tagged_variant(tmp_path, wrong), config=per,
                         budget=Budget(seeds=1, max_tokens=40), timeout_s=120)
    assert rep.verdict == "reject" and any("wanted TAG" in r for r in rep.reasons)


def test_a_bucket_without_a_config_gets_the_default_and_one_config_is_no_table(tmp_path):
    from autoopt.eval.plan import Budget
    from autoopt.eval.run import PerBucket

    assert PerBucket.of("swiglu", {"T=1": {"A": 1}, "T=8": {"A": 1}}) is None
    assert PerBucket.of("swiglu", {}) is None
    per = PerBucket.of("swiglu", {"T=1": None, "T=16": {"TAG": 16}})
    rule = "0 if t <= 4 else 16"  # T = 1's bucket has none: DEFAULT_CONFIG; 4 ties to 1
    rep = verify_variant("swiglu", _tagged_variant(tmp_path, rule), config=per,
                         budget=Budget(seeds=1, max_tokens=24), timeout_s=120)
    assert rep.verdict == "pass", rep.reasons


def test_a_call_at_widths_the_configs_were_not_tuned_for_gets_the_default(tmp_path):
    # As serving's lookup: tuned configs at the target's widths, DEFAULT_CONFIG elsewhere (and
    # on a GPU of the arch with no tuned configs), so the default is judged too.
    from autoopt.eval.plan import Budget
    from autoopt.eval.run import PerBucket
    from autoopt.eval.shapes import default_shapes

    served = default_shapes("swiglu", "cpu")
    widths = sorted({s["I"] for s in served})
    per = PerBucket.of("swiglu", _BUCKETS, served)
    assert per.dims_at == ((0, 1),) and per.served == tuple((w,) for w in widths)
    rule = (f"(1 if t <= 2 else 8 if t <= 22 else 64) if gate.shape[1] in {widths} else 0")
    rep = verify_variant("swiglu", _tagged_variant(tmp_path, rule), config=per,
                         budget=Budget(seeds=1, max_tokens=40), timeout_s=120)
    assert rep.verdict == "pass", rep.reasons
    drawn = [s for s in rep.shapes if s["I"] not in widths]
    assert drawn, "the CPU plan draws cases at other widths"
    everywhere = "1 if t <= 2 else 8 if t <= 22 else 64"  # the table at every width: wrong here
    rep = verify_variant("swiglu", _tagged_variant(tmp_path, everywhere), config=per,
                         budget=Budget(seeds=1, max_tokens=40), timeout_s=120)
    assert rep.verdict == "reject" and any("wanted TAG" in r for r in rep.reasons)


def test_the_workers_bucket_rule_is_the_registrys():
    from autoopt.eval.worker import nearest_bucket
    from model.registry.configs import ConfigTable

    buckets = (1, 2, 4, 8, 16, 32, 48, 64)
    table = ConfigTable.from_json({"NVIDIA H200": {"H=5120": {f"T={b}": {"B": b}
                                                             for b in buckets}}})
    rows = [(b, {"B": b}) for b in buckets]
    for t in range(0, 5000):
        got = table.lookup("NVIDIA H200", (("H", 5120),), t)
        assert nearest_bucket(rows, t) == dict(got), t


def test_verify_takes_a_config_or_a_config_per_bucket_from_the_command_line(tmp_path):
    # A verdict of the loop's names its configs; `autoopt verify` reproduces it with them.
    from typer.testing import CliRunner

    from autoopt.cli import app
    from autoopt.eval.commands import parse_config
    from autoopt.eval.run import PerBucket

    assert parse_config("swiglu", None, None) is None
    assert parse_config("swiglu", '{"BLOCK": 64}', None) == {"BLOCK": 64}
    per = parse_config("swiglu", None, '{"T=1": {"A": 1}, "T=8": {"A": 2}}')
    assert isinstance(per, PerBucket) and per.describe() == {"T=1": {"A": 1}, "T=8": {"A": 2}}
    assert parse_config("swiglu", None, '{"T=1": {"A": 1}, "T=8": {"A": 1}}') == {"A": 1}
    for config, configs, why in [('{"A": 1}', '{"T=1": {}}', "either --config"),
                                 ("[1]", None, "JSON object"), ("{oops", None, "must be JSON"),
                                 (None, '{"8": {"A": 1}}', "bad keys"),
                                 (None, '{"T=1": 3}', "bad keys"), (None, "{}", "none given")]:
        with pytest.raises(ValueError, match=why):
            parse_config("swiglu", config, configs)
    src = _tagged_variant(tmp_path, "1 if t <= 2 else 8 if t <= 22 else 64")
    runner = CliRunner()
    args = ["verify", "--op", "swiglu", "--source", str(src), "--device", "cpu", "--seeds", "0"]
    ok = runner.invoke(app, [*args, "--configs", '{"T=1": {"TAG": 1}, "T=8": {"TAG": 8}, '
                                                '"T=64": {"TAG": 64}}'])
    assert ok.exit_code == 0, ok.output
    one = runner.invoke(app, [*args, "--config", '{"TAG": 1}'])
    assert one.exit_code == 1 and "wanted" in one.output
    bad = runner.invoke(app, [*args, "--configs", '{"T=1": 3}'])
    assert bad.exit_code == 2
