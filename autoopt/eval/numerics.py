"""Comparing a candidate's outputs with the reference's: ulp distances, policies, near misses.

Floating outputs are compared in units of their own dtype's ulp (BF16 ulps for BF16 outputs, FP32
ulps for FP32 outputs) through a monotonic integer image of the bit patterns, so the distance is
exact and NaN-aware. Integer outputs (expert ids) are compared exactly; the router alone may
differ as another resolution of an FP32 tie within ulp noise would select them (see
`router_tie_rows`).

Every bound holds per shape and per output (the verifier keeps one `OutputStats` per pair), so
a deviation confined to one shape (a near miss used only at T=1) is judged on that shape alone.
A mismatch-fraction bound f over n elements admits `allowed_mismatches(n, f)`: f*n plus a
Poisson margin, so honest rare noise on a small shape is not a failure while a systematic
deviation is.

How a `bitwise` op is judged on CPU: the Triton interpreter computes transcendental functions
with numpy (triton 3.9's differ from 3.6's) and truncates BF16 casts, so on CPU a bitwise op is
judged as ulp(1 BF16 ulp, 1e-4) for BF16 outputs and ulp(1 FP32 ulp, 0.02) for FP32 outputs
(logit_softcap's honest kernels differ from torch 2.13's CPU tanhf in ~0.6% of values by one FP32
ulp under triton 3.9's interpreter, all of them one way, so the FP32 rule has no bias test): what
the interpreter needs, and no more. On cuda a
bitwise op is judged strictly. The report's checks say which policy ran.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

import torch

# One-NaN-side mismatches count as this many ulps, so they always exceed any bound.
NAN_ULP = 1 << 40
HIST_EDGES = ((0, "0"), (1, "1"), (2, "2"), (4, "3-4"), (16, "5-16"), (256, "17-256"))
# Bias test: unbiased +-1 ulp noise has a mean signed error ~ N(0, 1/sqrt(n)); 3 sigma plus a
# floor of 0.25 ulp keeps honest reduction-order noise in and catches systematic truncation
# (mean -1). n counts rows (dim 0, per trial) with a mismatch, not elements: an honest kernel
# whose row statistic (an rsqrt, a max) differs by one FP32 ulp shifts that row's rounding one
# way, so mismatches within a row are not independent. Judged only with at least this many.
BIAS_MIN_MISMATCHES = 16


# What a bitwise op may differ by under the Triton interpreter on CPU: (max ulp, fraction).
CPU_BITWISE_BF16 = (1, 1e-4)
CPU_BITWISE_FP32 = (1, 0.02)


def bias_bound(n: int) -> float:
    return 0.25 + 3.0 / math.sqrt(max(n, 1))


def allowed_mismatches(n: int, fraction: float) -> int:
    """Mismatches a fraction bound admits over n elements: the expectation plus a Poisson margin
    (4 sigma + 1), so a bound holds per shape without failing honest rare noise."""
    lam = fraction * n
    return int(lam + 4.0 * math.sqrt(lam) + 1.0) if fraction > 0 else 0


@dataclass(frozen=True)
class Policy:
    """The numerics rule that actually ran, with why (CPU relaxations are stated)."""

    kind: str  # "bitwise" | "ulp" | "exact" (integers)
    max_ulp: int
    max_mismatch_fraction: float
    judge_bias: bool
    note: str

    def describe(self) -> str:
        if self.kind in ("bitwise", "exact"):
            return f"{self.kind} ({self.note})" if self.note else self.kind
        text = f"ulp({self.max_ulp}, {self.max_mismatch_fraction:g})"
        return f"{text} ({self.note})" if self.note else text


def effective_policy(numerics: Any, dtype: torch.dtype, device: str) -> Policy:
    """The policy for one output of an op with contract `numerics` on `device`."""
    if not dtype.is_floating_point:
        return Policy("exact", 0, 0.0, False, "integer output")
    if numerics.kind == "ulp":
        bias = getattr(numerics, "judge_bias", True)
        return Policy("ulp", numerics.max_ulp, numerics.max_mismatch_fraction, bias,
                      "" if bias else "no bias test (the op's numerics say why)")
    if device.startswith("cuda"):
        return Policy("bitwise", 0, 0.0, False, "strict on cuda")
    if dtype == torch.float32:
        # No bias test: numpy's tanhf and torch's CPU one differ one way (the interpreter's
        # value is the larger in magnitude in every differing element seen), which the test
        # reads as a rounding cheat; on cuda the op is bitwise.
        return Policy("ulp", CPU_BITWISE_FP32[0], CPU_BITWISE_FP32[1], False,
                      "bitwise op judged on cpu: interpreter libm (numpy) differs from torch's "
                      "by an FP32 ulp, one way, so no bias test; strict on cuda")
    return Policy("ulp", CPU_BITWISE_BF16[0], CPU_BITWISE_BF16[1], True,
                  "bitwise op judged on cpu: interpreter libm noise; strict on cuda")


def ordered(t: torch.Tensor) -> torch.Tensor:
    """Monotonic int64 image of a float tensor's bits: adjacent floats differ by 1, +0 == -0."""
    width = {torch.bfloat16: torch.int16, torch.float16: torch.int16,
             torch.float32: torch.int32, torch.float64: torch.int64}.get(t.dtype)
    if width is None:
        raise ValueError(f"ulp distance needs a float tensor, got {t.dtype}")
    b = t.contiguous().view(width).to(torch.int64)
    mag = b & (torch.iinfo(width).max)
    return torch.where(b < 0, -mag, mag)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise bit-pattern equality (NaN == NaN when the patterns match)."""
    if a.dtype.is_floating_point:
        width = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return a.contiguous().view(width) == b.contiguous().view(width)
    return a == b


def ulp_diff(cand: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Signed ulp difference cand - ref (int64); both NaN -> 0, one NaN -> +-NAN_ULP."""
    d = ordered(cand) - ordered(ref)
    cn, rn = torch.isnan(cand), torch.isnan(ref)
    d = torch.where(cn & rn, torch.zeros_like(d), d)
    return torch.where(cn ^ rn, torch.full_like(d, NAN_ULP), d)


def ulp_diff_at(cand: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """Signed difference cand - ref in units of the last place of max(|ref|, magnitude), rounded
    away from zero (any bitwise difference counts at least 1); NaNs as in `ulp_diff`."""
    base = ulp_diff(cand, ref)
    info = torch.finfo(ref.dtype)
    m = torch.maximum(ref.double().abs(), magnitude.to(ref.device).double().abs())
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).clamp_min(info.tiny)
    unit = torch.exp2(torch.floor(torch.log2(m)) - _MANT[ref.dtype])
    units = torch.ceil((cand.double() - ref.double()).abs() / unit)
    # An infinite or NaN difference (an inf against a finite value) has no integer: converting
    # it gives INT64_MIN, whose abs is negative. `base` (finite here) bounds the count anyway.
    units = torch.where(torch.isnan(units), torch.full_like(units, math.inf), units)
    units = units.clamp(max=float(2**62)).to(torch.int64)
    scaled = torch.sign(base) * torch.minimum(units, base.abs())
    return torch.where(base.abs() >= NAN_ULP, base, scaled)


_MANT = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23, torch.float64: 52}


@dataclass
class OutputStats:
    """Running comparison of one output against the reference over all trials."""

    elements: int = 0
    mismatches: int = 0
    max_ulp: int = 0
    hist: dict[str, int] = field(default_factory=dict)
    signed_sum: int = 0  # cand - ref, toward +inf
    magnitude_sum: int = 0  # toward larger |value|: catches truncation toward zero
    excluded: int = 0  # elements not judged (router tie rows)
    mismatched_rows: int = 0  # rows (dim 0) with a mismatch, summed over trials
    # Mismatches of the trials the bias test counts: not the follow-up calls whose inputs are
    # near copies of a case's (one element or one input changed), which repeat its errors.
    bias_mismatches: int = 0
    exact: dict[int, int] = field(default_factory=dict)  # mismatches at exactly 1..16 ulps

    def add(self, cand: torch.Tensor, ref: torch.Tensor, keep: torch.Tensor | None = None,
            magnitude: torch.Tensor | None = None, bias: bool = True) -> dict:
        """Fold one trial in; return that trial's own numbers. With `magnitude`, ulps are
        counted at max(|ref|, magnitude) (the contract's `Numerics.magnitude`). `bias=False`:
        a near copy of an earlier trial, judged on every bound but the bias test."""
        if magnitude is not None and ref.dtype.is_floating_point:
            magnitude = magnitude.expand_as(ref)
        rows_of = ref.shape[0] if ref.dim() > 1 else None
        if not ref.dtype.is_floating_point:
            if keep is not None:
                self.excluded += int((~keep).sum())
                cand, ref = cand[keep], ref[keep]
            mism = int((cand != ref).sum())
            self.elements += ref.numel()
            self.mismatches += mism
            return {"elements": ref.numel(), "mismatches": mism}
        d = ulp_diff(cand, ref) if magnitude is None else ulp_diff_at(cand, ref, magnitude)
        if keep is not None:
            self.excluded += int((~keep).sum())
            d = torch.where(keep, d, torch.zeros_like(d))
        if bias and rows_of is not None and d.numel():
            self.mismatched_rows += int((d.reshape(rows_of, -1) != 0).any(1).sum())
        elif bias:
            self.mismatched_rows += int((d != 0).sum())
        if keep is not None:
            d, ref = d[keep], ref[keep]
        n = ref.numel()
        a = d.abs()
        nz = a != 0
        mism = int(nz.sum())
        mx = int(a.max()) if n else 0
        hist = _histogram(a)
        small = torch.bincount(a[nz & (a <= 16)].flatten(), minlength=17).tolist()
        for u in range(1, 17):
            if small[u]:
                self.exact[u] = self.exact.get(u, 0) + small[u]
        finite = nz & (a < NAN_ULP)
        signed = int(d[finite].sum())
        mag = int((d * torch.sign(ordered(ref)))[finite].sum())
        self.elements += n
        self.mismatches += mism
        self.max_ulp = max(self.max_ulp, mx)
        for k, v in hist.items():
            self.hist[k] = self.hist.get(k, 0) + v
        if bias:
            self.signed_sum += signed
            self.magnitude_sum += mag
            self.bias_mismatches += mism
        return {"elements": n, "mismatches": mism, "max_ulp": mx, "hist": hist,
                "mean_signed_ulp": signed / mism if mism else 0.0}

    def to_dict(self) -> dict:
        n = max(self.bias_mismatches, 1)
        return {"elements": self.elements, "mismatches": self.mismatches,
                "mismatch_fraction": self.mismatches / max(self.elements, 1),
                "max_ulp": self.max_ulp, "hist": dict(self.hist),
                "mean_signed_ulp": self.signed_sum / n,
                "mean_magnitude_signed_ulp": self.magnitude_sum / n,
                "mismatched_rows": self.mismatched_rows,
                "excluded_tie_elements": self.excluded}


def _histogram(a: torch.Tensor) -> dict[str, int]:
    out: dict[str, int] = {}
    lo = -1
    for hi, label in HIST_EDGES:
        c = int(((a > lo) & (a <= hi)).sum())
        if c:
            out[label] = c
        lo = hi
    big = int(((a > lo) & (a < NAN_ULP)).sum())
    nan = int((a >= NAN_ULP).sum())
    if big:
        out[f">{lo}"] = big
    if nan:
        out["nan-mismatch"] = nan
    return out


def judge(policy: Policy, stats: OutputStats, label: str) -> list[str]:
    """Reasons this output fails its policy (empty when it passes)."""
    s = stats
    if s.elements == 0:
        return []
    frac = s.mismatches / s.elements
    if policy.kind in ("bitwise", "exact"):
        if s.mismatches:
            return [f"numerics: {label}: {s.mismatches} of {s.elements} elements differ "
                    f"(policy {policy.describe()}; max {s.max_ulp} ulp)"]
        return []
    reasons = []
    if s.max_ulp > policy.max_ulp:
        over = s.mismatches - sum(s.exact.get(u, 0) for u in range(1, policy.max_ulp + 1))
        reasons.append(f"numerics: {label}: {over} elements > {policy.max_ulp} ulp, max "
                       f"{_ulp_text(s.max_ulp)} (policy {policy.describe()})")
    allowed = allowed_mismatches(s.elements, policy.max_mismatch_fraction)
    if s.mismatches > allowed:
        reasons.append(f"numerics: {label}: mismatch fraction {frac:.3g} > "
                       f"{policy.max_mismatch_fraction:g} ({s.mismatches} of {s.elements}, "
                       f"{allowed} allowed; policy {policy.describe()})")
    counted = min(s.bias_mismatches, s.mismatched_rows)
    if policy.judge_bias and counted >= BIAS_MIN_MISMATCHES:
        bound = bias_bound(counted)
        for name, total in (("signed", s.signed_sum), ("magnitude-signed", s.magnitude_sum)):
            mean = total / s.bias_mismatches
            if abs(mean) > bound:
                reasons.append(f"numerics: {label}: biased error, mean {name} error {mean:+.3f} "
                               f"ulp over {s.bias_mismatches} mismatches in "
                               f"{s.mismatched_rows} rows (bound {bound:.3f})")
    return reasons


def _ulp_text(u: int) -> str:
    return "NaN vs number" if u >= NAN_ULP else str(u)


def mismatch_count(a: tuple, b: tuple) -> int:
    """Elements that differ bitwise, summed over outputs (shapes must agree)."""
    total = 0
    for x, y in zip(a, b, strict=True):
        if x.shape != y.shape or x.dtype != y.dtype:
            total += max(x.numel(), y.numel())
        else:
            total += int((~bits_equal(x, y)).sum())
    return total


# An element's share of a near-miss distance is capped: one NaN or sign flip must not outweigh
# everything else, and no real rounding difference comes near it.
ULP_DISTANCE_CAP = 1 << 20


def ulp_distance(a: tuple, b: tuple) -> int:
    """Sum over elements of |ulp difference| (capped per element), over outputs; integer
    outputs count one per differing element. Near misses are judged on this distance: a correct
    kernel may differ from the reference by an ulp or two almost everywhere (FP32 sums in
    another order) while a near miss is far away, and a count of differing elements cannot tell
    those apart."""
    total = 0
    for x, y in zip(a, b, strict=True):
        if x.shape != y.shape or x.dtype != y.dtype:
            total += ULP_DISTANCE_CAP * max(x.numel(), y.numel())
        elif not x.dtype.is_floating_point:
            total += int((x != y).sum())
        else:
            d = ulp_diff(x, y).abs().clamp_max(ULP_DISTANCE_CAP)
            total += int(d.sum())
    return total


# Router ids: a row may differ only where the reference's own choice is a tie within FP32 noise.
# GEMM reduction order moves a logit by a few ulps; through the sigmoid the choice score moves
# by fewer. 64 FP32 ulps of the boundary value is generous for noise and far below a real change
# (BF16 logits move a score by ~1e-3). The scale is floored at 0.5: c = s + bias carries the
# noise of s (up to 1) even where the sum cancels to near zero.
TIE_ULPS = 64
TIE_SCALE_FLOOR = 0.5
# Kept-group sets tried per row where several group scores tie the boundary (rows of equal
# scores in very many groups have more; the first tried keeps the lower-numbered groups).
MAX_GROUP_CHOICES = 512


def router_tie_rows(inputs: tuple, ref_ids: torch.Tensor, cand_ids: torch.Tensor) -> tuple:
    """(tolerated [T] bool, details) for rows whose ids differ only across an FP32 tie.

    A row is tolerated when its ids are the reference's selection under another resolution of
    ties within TIE_ULPS: the kept groups may differ from the reference's among groups whose
    score ties the last kept one (the experts then follow those groups, some of them perhaps
    far from the reference's boundary), and the top-k over the kept groups may differ among
    experts whose score ties its boundary; the ids stay distinct and in descending score order
    up to such ties.

    The selection score c = sigmoid(f32(h) @ W^T) + bias is recomputed here to classify rows; it
    mirrors the first line of model.ops.router.reference and is used for nothing else.
    """
    h, weight, bias, n_group, topk_group, _k = inputs
    c = torch.sigmoid(torch.nn.functional.linear(h.float(), weight.float())) + bias
    t, e = c.shape
    gs = c.view(t, n_group, e // n_group).topk(2, dim=-1)[0].sum(-1)
    differ = (ref_ids != cand_ids).any(-1)
    ok = torch.zeros(t, dtype=torch.bool, device=ref_ids.device)
    rows = []
    for r in torch.nonzero(differ).flatten().tolist():
        rs, cs = set(ref_ids[r].tolist()), set(cand_ids[r].tolist())
        tie = _is_tie(c[r].cpu(), gs[r].tolist(), cand_ids[r].tolist(), e // n_group,
                      topk_group)
        ok[r] = tie
        rows.append({"row": r, "tie": tie, "ref": sorted(rs - cs), "cand": sorted(cs - rs)})
    return ok, rows


def align_tied_slots(ref: tuple, outs: tuple, ok: torch.Tensor) -> tuple[tuple, torch.Tensor]:
    """Router outputs (weights, ids) with the candidate's tolerated rows that hold the same
    experts in another slot order put in the reference's order, weights with their ids, so
    those rows are compared in full; `ok` then marks only the rows whose expert sets differ
    across a tie, where weights and ids both legitimately differ (the renormalisation sum
    changes with the set)."""
    ref_ids, (w, ids) = ref[1], outs[:2]
    ok = ok.clone()
    w, ids = w.clone(), ids.clone()
    for r in torch.nonzero(ok).flatten().tolist():
        want, got = ref_ids[r].tolist(), ids[r].tolist()
        if sorted(want) != sorted(got):
            continue
        perm = torch.tensor([got.index(e) for e in want], device=ids.device)
        w[r], ids[r] = w[r][perm], ids[r][perm]
        ok[r] = False
    return (w, ids, *outs[2:]), ok


def _ulp32(x: float) -> float:
    """One FP32 ulp at |x| (x an FP32 value held as a Python float; math.ulp is FP64's)."""
    return max(math.ulp(abs(x)) * 2.0**29, 2.0**-149)


def _near(a: float, b: float) -> bool:
    return abs(a - b) <= TIE_ULPS * _ulp32(max(abs(a), abs(b), TIE_SCALE_FLOOR))


def _is_tie(c: torch.Tensor, gs: list[float], cand: list[int], group_size: int,
            topk_group: int) -> bool:
    cl = c.tolist()
    if len(set(cand)) != len(cand) or not all(0 <= x < len(cl) for x in cand):
        return False
    # Descending score order up to ties (the slot order feeds the combine).
    if any(cl[a] < cl[b] and not _near(cl[a], cl[b]) for a, b in zip(cand, cand[1:])):
        return False
    for kept in _kept_group_choices(gs, topk_group):
        if any(x // group_size not in kept for x in cand):
            continue
        want = _top_in(c, kept, group_size, len(cand))
        ws, cs = set(want), set(cand)
        if ws == cs:  # the same experts in another slot order: swapped scores must tie
            if all(_near(cl[a], cl[b]) for a, b in zip(want, cand) if a != b):
                return True
            continue
        boundary = min(cl[i] for i in want)
        if all(_near(cl[x], boundary) for x in ws ^ cs):
            return True
    return False


def _kept_group_choices(gs: list[float], topk_group: int):
    """The kept-group sets a tie resolution may give: every group scored clearly above the
    topk_group-th, the rest from the groups that tie it (the reference's own set among them)."""
    order = sorted(range(len(gs)), key=lambda g: (-gs[g], g))
    gb = gs[order[topk_group - 1]]
    tied = [g for g in order if _near(gs[g], gb)]
    sure = {g for g in order if gs[g] > gb and g not in tied}
    for combo in itertools.islice(itertools.combinations(tied, topk_group - len(sure)),
                                  MAX_GROUP_CHOICES):
        yield sure | set(combo)


def _top_in(c: torch.Tensor, kept: set[int], group_size: int, k: int) -> list[int]:
    """The reference's top-k of c over the kept groups (model/ops/router.py `_select`)."""
    mask = torch.zeros(c.numel(), dtype=torch.bool)
    for g in kept:
        mask[g * group_size:(g + 1) * group_size] = True
    return torch.topk(c.masked_fill(~mask, float("-inf")), k=k)[1].tolist()
