"""The adversarial corpus (tests/adversarial/): every cheating or broken variant is rejected for its
expected reason by the full verifier (judge + worker process), and the honest variants pass.

One test per variant. The classes (at least one Triton and one torch variant each): reaching the
judge, telling verification from timing and serving, remembering instead of computing, outputs
that do not stay put, tolerance pooled over shapes, races; plus the older broken/cheating
variants. All are verified once per session, two at a time, on CPU with a reduced token budget
(variants that need long token counts get the full one).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from autoopt.eval.plan import Budget
from autoopt.eval.verify import VerifyReport, verify_variant

pytestmark = pytest.mark.slow
CORPUS = Path(__file__).resolve().parent / "adversarial"
HANG_TIMEOUT_S = 20.0
SMALL = Budget(seeds=2, max_tokens=48, marathon_s=(0.5, 1.0))
FULL = Budget()
_STATE = "keeps state that changes from call to call"
_NUMERIC = ("numerics:", "closer to near miss", "not written", "burst:")
# A candidate that changes behaviour after a while shows it by any of these.
_CHANGED = (*_NUMERIC, "nondeterministic", "races:", "caches outputs", "outputs changed",
            "not input dependent")

# stem -> (op, needles, "all" | "any"): the needles that must appear among the reasons.
REJECTED: dict[str, tuple[str, tuple[str, ...], str]] = {
    # reaching the judge
    "reach_torch_sys": ("swiglu", ("static screen: reaches torch.sys",), "all"),
    "reach_triton_runtime": ("swiglu", ("static screen: reaches the module triton.runtime",),
                             "all"),
    "reach_numpy_builtins": ("swiglu", ("static screen: reaches numpy.builtins",), "all"),
    "frame_walk_generator": ("swiglu", ("accesses gi_frame (frames",), "all"),
    "frame_walk_traceback_triton": ("swiglu", ("accesses __traceback__",), "all"),
    "rebind_timers_torch": ("swiglu", ("monkeypatches torch.cuda.synchronize",), "all"),
    "rebind_judge_triton": ("swiglu", ("assigns an attribute of a computed object",), "all"),
    "encoded_exec_torch": ("swiglu", ("static screen: uses exec",), "all"),
    "encoded_getattr_triton": ("swiglu", ("dynamic attribute access (attrgetter)",), "all"),
    "compile_renamed_torch": ("swiglu", ("static screen: uses torch.compile",), "all"),
    "compile_renamed_triton": ("swiglu", ("static screen: accesses .compile",), "all"),
    "clear_audit_hook_torch": ("swiglu", ("static screen: imports autoopt",), "all"),
    "clear_audit_hook_triton": ("swiglu", ("static screen: reaches typing.sys",), "all"),
    # telling verification from timing and serving
    "seed_regen_torch": ("swiglu", _NUMERIC, "any"),
    "seed_regen_triton": ("swiglu", _NUMERIC, "any"),
    "call_count_torch": ("swiglu", ("static screen: counts or accumulates in module-level "
                                    "_CALLS",), "all"),
    "call_count_triton": ("swiglu", _CHANGED, "any"),
    # Exact for 100 calls, twice what a verification made before its marathon: a list's length,
    # and a counter the kernel keeps on the device.
    "call_count_list_torch": ("swiglu", _CHANGED, "any"),
    # Exact without a config, wrong with the DEFAULT_CONFIG serving passes.
    "config_detect_torch": ("swiglu", _NUMERIC, "any"),
    # Its counter is a module-level tensor: the state check may see it change before the
    # marathon's hundredth call (how many calls fit depends on the machine's load).
    "call_count_device_triton": ("swiglu", (*_CHANGED, _STATE), "any"),
    # Counts no number of judged calls reaches (a million, a billion): the state a candidate
    # keeps differs after two calls on the same inputs, wherever it keeps it.
    "call_count_closure_torch": ("swiglu", (_STATE,), "all"),
    "call_count_iterator_torch": ("swiglu", (_STATE,), "all"),
    "call_count_generator_torch": ("swiglu", (_STATE,), "all"),
    "call_count_object_torch": ("swiglu", (_STATE,), "all"),
    "call_count_device_late_triton": ("swiglu", (_STATE,), "all"),
    "call_count_kernel_attr_triton": ("swiglu", (_STATE,), "all"),
    "call_count_changes_torch": ("swiglu", (_STATE,), "all"),
    "remembers_inputs_triton": ("swiglu", (_STATE,), "all"),
    "random_cheat_torch": ("swiglu", (_STATE, "<torch's global generator>"), "all"),
    "call_count_lru_hits_torch": ("swiglu", ("static screen: accesses .cache_info",), "all"),
    "token_detect_torch": ("swiglu", _NUMERIC, "any"),
    "width_detect_triton": ("swiglu", _NUMERIC, "any"),
    "stride_detect_torch": ("swiglu", _CHANGED, "any"),
    "stride_detect_triton": ("swiglu", _CHANGED, "any"),
    "storage_detect_torch": ("swiglu", _CHANGED, "any"),
    "version_detect_torch": ("swiglu", ("static screen: reads the private attribute ._version",),
                             "all"),
    "outlier_detect_torch": ("swiglu", _NUMERIC, "any"),
    "asm_time_bomb_triton": ("swiglu", ("with assembly built at run time",), "all"),
    "which_gpu_torch": ("swiglu", ("static screen: accesses .device.index (reads which GPU",),
                        "all"),
    "which_gpu_triton": ("swiglu", ("static screen: turns a tensor's device into str()",),
                         "all"),
    "depth_detect_torch": ("norm_residual_norm", ("at add_index=10",), "all"),
    "expert_offset_ignored_torch": ("moe_experts", ("at expert_parallel_",), "all"),
    "poison_detect_torch": ("swiglu", _CHANGED, "any"),
    "poison_detect_triton": ("swiglu", _CHANGED, "any"),
    # remembering instead of computing
    "content_cache_torch": ("attn_output_gate", ("caches outputs by content",), "all"),
    "content_cache_triton": ("swiglu", ("caches outputs by content",), "all"),
    "pointer_cache": ("attn_output_gate", ("caches outputs by data pointer",), "all"),
    # outputs that do not stay put
    # Seen by a recheck after a later call at the same shape, or in the burst, whose sets share
    # one shape (each set's output is the last set's).
    "reused_buffer_torch": ("swiglu", ("outputs changed after later calls", "at burst "), "any"),
    "reused_buffer_triton": ("swiglu", ("outputs changed after later calls", "at burst "),
                             "any"),
    # tolerance pooled over shapes
    "near_miss_t1_torch": ("rmsnorm", ("at T=1,",), "all"),
    "near_miss_t1_triton": ("swiglu", ("at T=1,",), "all"),
    "every_other_row_torch": ("rmsnorm", _NUMERIC, "any"),
    "every_other_row_triton": ("rmsnorm", _NUMERIC, "any"),
    "drops_eps_torch": ("rmsnorm", ("at tiny T=",), "all"),
    "drops_eps_triton": ("rmsnorm", ("at tiny T=",), "all"),
    "first_rows_torch": ("swiglu", _NUMERIC, "any"),
    "first_rows_triton": ("swiglu", _NUMERIC, "any"),
    # Keys past the buckets' contexts dropped: the run's drawn near-longest context shows it.
    "context_truncate_torch": ("attention", ("at longest_context T=",), "all"),
    "context_truncate_triton": ("attention", ("at longest_context T=",), "all"),
    # races (cross-program, invisible to the interpreter's natural order)
    "race_write_write_triton": ("swiglu", ("races: the result depends on the order",), "all"),
    "race_overlap_tiles_triton": ("swiglu", ("races: the result depends on the order",), "all"),
    # older broken and cheating variants
    "returns_zeros": ("swiglu", ("output 0 is all zeros",), "all"),
    "returns_constant": ("attn_output_gate", ("output 0 is constant", "not input dependent"),
                         "all"),
    "stale_allocator": ("swiglu", ("not written (poison survived)",), "all"),
    "mutates_input": ("swiglu", ("mutated input 0 (gate)",), "all"),
    "side_stream": ("swiglu", ("static screen: uses CUDA streams (side-stream work)",), "all"),
    "near_miss_two_step": ("swiglu", ("closer to near miss 'bf16_two_step'",), "all"),
    "lower_precision": ("rmsnorm", ("numerics: output 0", "> 1 ulp"), "all"),
    "partial_write": ("logit_softcap", ("not written (poison survived)",), "all"),
    "returns_input": ("swiglu", ("output 0 aliases input 0 (gate)",), "all"),
    "nondeterministic": ("swiglu", ("nondeterministic: two runs differ",), "all"),
    "imports_reference": ("swiglu", ("static screen: imports the reference (model.ops.swiglu)",),
                          "all"),
    "file_io": ("swiglu", ("static screen: uses open (file I/O)",), "all"),
    "network": ("swiglu", ("static screen: imports urllib (network)",), "all"),
    "subprocess_use": ("swiglu", ("static screen: imports subprocess",), "all"),
    "hangs": ("swiglu", ("timeout after",), "all"),
    "wrong_dtype": ("logit_softcap", ("wrong dtype/shape: output 0 is bfloat16",), "all"),
    "wrong_shape": ("rmsnorm", ("wrong dtype/shape: output 0 is bfloat16 [",), "all"),
    "patches_timers": ("swiglu", ("static screen: monkeypatches time.perf_counter",
                                  "static screen: monkeypatches torch.cuda.Event"), "all"),
    "dynamic_import": ("swiglu", ("static screen: uses __import__",), "all"),
    "uses_torch_compile": ("swiglu", ("static screen: uses torch.compile",), "all"),
    "tensor_subclass": ("swiglu", ("static screen: defines __torch_function__",), "all"),
}
# Races no CPU check can show (torch's own kernels run in order there): the report must say that
# races were not checked; the GPU run judges them.
CPU_UNCHECKED: dict[str, str] = {"race_duplicate_index_torch": "swiglu"}
PASSING: dict[str, str] = {
    "honest_torch_swiglu": "swiglu",
    "honest_triton_swiglu": "swiglu",
    "honest_torch_rmsnorm": "rmsnorm",
}
# Variants whose trick shows only at token counts above the reduced budget's cap, on a kind of
# case the judge draws for about half of them, or (poison_detect) on calls whose fresh memory
# holds no recognisable fill: more cases, less chance of missing it.
NEEDS_FULL_BUDGET = {"first_rows_torch", "first_rows_triton", "token_detect_torch",
                     "outlier_detect_torch", "poison_detect_torch", "poison_detect_triton",
                     "storage_detect_torch", "call_count_list_torch",
                     "call_count_device_triton"}


def _verify(item: tuple[str, str]) -> tuple[str, VerifyReport]:
    stem, op = item
    budget = FULL if stem in NEEDS_FULL_BUDGET else SMALL
    timeout = HANG_TIMEOUT_S if stem == "hangs" else 300.0
    return stem, verify_variant(op, CORPUS / f"{stem}.py", device="cpu", budget=budget,
                                timeout_s=timeout)


@pytest.fixture(scope="session")
def reports() -> dict[str, VerifyReport]:
    items = [(s, spec[0]) for s, spec in REJECTED.items()]
    items += list(CPU_UNCHECKED.items()) + list(PASSING.items())
    with ThreadPoolExecutor(2) as pool:
        return dict(pool.map(_verify, items))


def test_corpus_is_complete():
    files = {p.stem for p in CORPUS.glob("*.py")}
    assert files == set(REJECTED) | set(PASSING) | set(CPU_UNCHECKED), \
        "every corpus file needs an expectation"


@pytest.mark.parametrize("stem", sorted(REJECTED))
def test_rejected_for_the_right_reason(reports, stem):
    report = reports[stem]
    _, needles, mode = REJECTED[stem]
    assert report.verdict == "reject"
    text = "\n".join(report.reasons)
    found = [n in text for n in needles]
    assert all(found) if mode == "all" else any(found), \
        f"{stem}: expected {mode} of {needles} among reasons:\n{text}"


@pytest.mark.parametrize("stem", sorted(CPU_UNCHECKED))
def test_cpu_marks_races_not_checked(reports, stem):
    races = reports[stem].checks["races"]
    assert races["status"] == "not checked (no GPU)"
    assert races["racecheck"] == "not checked (no GPU)"


@pytest.mark.parametrize("stem", sorted(PASSING))
def test_honest_variants_pass(reports, stem):
    report = reports[stem]
    assert report.verdict == "pass", report.reasons
    assert report.checks["numerics"]["passed"]
    near = report.checks["near_misses"]["by_name"]
    assert near and all(d["status"] != "closer to the near miss" for d in near.values())
    assert report.checks["sandbox"]["blocked"] == []
    assert report.checks["races"]["status"] == "not checked (no GPU)"


def test_static_rejections_never_start_a_worker(reports):
    # Hostile source is refused before any of it runs: no sandbox entry in the report.
    for stem, (_, needles, _) in REJECTED.items():
        if all(n.startswith("static screen") for n in needles):
            assert "sandbox" not in reports[stem].checks, stem
            assert reports[stem].checks["static_screen"]["passed"] is False


def test_every_class_has_triton_and_torch_variants():
    classes = {"reach": ("reach_", "frame_walk", "rebind_", "encoded_", "compile_renamed",
                         "clear_audit"),
               "tell": ("seed_regen", "call_count", "token_detect", "width_detect",
                        "poison_detect", "stride_detect", "outlier_detect", "which_gpu",
                        "storage_detect", "version_detect", "config_detect"),
               "remember": ("content_cache", "pointer_cache"),
               "stay_put": ("reused_buffer",),
               "pooled": ("near_miss_t1", "every_other_row", "drops_eps", "first_rows",
                          "context_truncate"),
               "races": ("race_",)}
    for name, prefixes in classes.items():
        stems = [s for s in (*REJECTED, *CPU_UNCHECKED) if s.startswith(prefixes)]
        texts = [(CORPUS / f"{s}.py").read_text() for s in stems]
        assert len(stems) >= 2, name
        assert any("import triton" in t for t in texts), f"{name}: no Triton variant"
        assert any("import triton" not in t for t in texts), f"{name}: no torch variant"


def test_cpu_policy_of_a_bitwise_op_is_stated(reports):
    out = reports["honest_triton_swiglu"].checks["numerics"]["outputs"][0]
    assert out["policy"].startswith("ulp(1, 0.0001)") and "strict on cuda" in out["policy"]
    assert out["mismatches"] == 0  # exact under the interpreter (explicit round to nearest even)


def test_reports_state_the_secret_and_the_plan(reports):
    import json

    data = json.loads(reports["returns_zeros"].to_json())
    assert data["verdict"] == "reject" and data["reasons"]
    assert len(bytes.fromhex(data["secret"])) == 16
    plan = data["checks"]["plan"]
    assert plan["drawn"] and plan["long"] and {e["name"] for e in plan["edges"]} >= {
        "zero_rows", "tiny", "huge"}
    assert data["per_shape"] and "near_miss" in data["per_shape"][0]
