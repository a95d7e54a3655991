"""Turning a session's evidence into reasons: numerics and near misses per shape and per output.

Every bound of the op's policy (max ulp, mismatch fraction with its Poisson margin, bias) is
judged on each (shape, output) pair on its own; a near miss must be strictly farther from the
candidate than the reference is at every shape where it differs from the reference by at least
as much as the candidate does (where it differs by less, the inputs cannot tell it from the
candidate's own error) and in at least NEAR_MISS_MIN_ELEMENTS elements. Nothing is pooled across
shapes, so a deviation used only at one token count is judged there.
"""

from __future__ import annotations

from typing import Any

from .numerics import OutputStats, effective_policy, judge
from .trials import Judge

# A near miss that differs from the reference in fewer elements than this at a shape (over its
# trials) gives no verdict there. Near misses that reorder an FP32 sum flip only the elements
# whose sum lies next to a BF16 rounding boundary, and an honest kernel that sums in any other
# order flips those same elements: one such element, where the kernel happened to round as the
# near miss does, rejected an honest MoE kernel (1 element of 1776, 1 ulp). A cheat that is the
# near miss is still judged wherever the inputs tell the two apart by this many elements, and
# where they cannot, the numerics policy still bounds what it returns.
NEAR_MISS_MIN_ELEMENTS = 8


def judge_numerics(j: Judge, device: str) -> tuple[list[str], dict[str, Any]]:
    reasons: list[str] = []
    by_shape: dict[str, list[dict]] = {}
    totals: dict[int, OutputStats] = {}
    failed_shapes = 0
    # Edge cases first (their keys start with the case's name, a plain shape's with "T=" or
    # another axis): of many failing pairs the reasons list four, and a named case says most.
    order = sorted(j.stats.items(), key=lambda kv: " " not in kv[0][0])
    for (key, i), stats in order:
        dtype = j.dtypes[i]
        policy = effective_policy(j.c.numerics, dtype, device)
        failed = judge(policy, stats, f"output {i} at {key}")
        if failed:
            failed_shapes += 1
            if failed_shapes <= 4:
                reasons += failed
        by_shape.setdefault(key, []).append({"output": i, "policy": policy.describe(),
                                             "passed": not failed, **stats.to_dict()})
        _fold(totals.setdefault(i, OutputStats()), stats)
    if failed_shapes > 4:
        reasons.append(f"numerics: {failed_shapes - 4} more (shape, output) pairs fail their "
                       f"policy")
    outputs = [{"policy": effective_policy(j.c.numerics, j.dtypes[i], device).describe(),
                "dtype": str(j.dtypes[i]), **totals[i].to_dict()} for i in sorted(totals)]
    check = {"passed": bool(j.stats) and not reasons, "per_shape": by_shape,
             "outputs": outputs, "judged": "per shape and per output",
             "contract": {"kind": j.c.numerics.kind, "max_ulp": j.c.numerics.max_ulp,
                          "max_mismatch_fraction": j.c.numerics.max_mismatch_fraction}}
    return reasons, check


def _fold(into: OutputStats, s: OutputStats) -> None:
    into.elements += s.elements
    into.mismatches += s.mismatches
    into.max_ulp = max(into.max_ulp, s.max_ulp)
    for k, v in s.hist.items():
        into.hist[k] = into.hist.get(k, 0) + v
    into.signed_sum += s.signed_sum
    into.magnitude_sum += s.magnitude_sum
    into.excluded += s.excluded
    into.mismatched_rows += s.mismatched_rows
    into.bias_mismatches += s.bias_mismatches
    for u, c in s.exact.items():
        into.exact[u] = into.exact.get(u, 0) + c


def judge_near_misses(j: Judge) -> tuple[list[str], dict[str, Any]]:
    reasons: list[str] = []
    table: dict[str, dict[str, Any]] = {}
    for (key, name), d in j.near.items():
        row = table.setdefault(name, {"shapes": {}, "status": "not run"})
        if d["trials"] == 0:
            status = "not run (the near miss failed on these shapes)"
        elif d["near_ref"] == 0:
            status = "not distinguishable on these inputs"
        elif d.get("cand_ref_ulps", d["cand_ref"]) < d.get("cand_near_ulps", d["cand_near"]):
            status = "closer to the reference"
        elif d.get("cand_ref_ulps", d["cand_ref"]) > d.get("near_ref_ulps", d["near_ref"]):
            # The near miss is nearer the reference than the candidate's own (legitimate) error
            # is: these inputs cannot tell the two apart, as when tiny router inputs put every
            # score at 0.5. Not a verdict either way. A candidate that is the near miss sits at
            # exactly its distance and is judged by the branch below; one that adds error to
            # stand farther off must keep that error inside the numerics policy.
            status = "not distinguishable from the candidate's own error on these inputs"
        elif d["near_ref"] < NEAR_MISS_MIN_ELEMENTS:
            status = (f"too few elements tell it from the reference on these inputs "
                      f"({d['near_ref']} < {NEAR_MISS_MIN_ELEMENTS})")
        else:
            status = "closer to the near miss"
            if not any(name in r for r in reasons):
                reasons.append(f"closer to near miss {name!r} than to the reference at {key} "
                               f"({d['cand_ref']} elements, {d.get('cand_ref_ulps')} ulps from "
                               f"the reference; {d['cand_near']} elements, "
                               f"{d.get('cand_near_ulps')} ulps from the near miss)")
        row["shapes"][key] = {"status": status, **d}
    for row in table.values():
        states = {v["status"] for v in row["shapes"].values()}
        row["status"] = ("closer to the near miss" if "closer to the near miss" in states else
                         "closer to the reference" if "closer to the reference" in states else
                         sorted(states)[0] if states else "not run")
    return reasons, {"passed": not reasons, "by_name": table, "judged": "per shape"}
