"""The verify job's trials, run inside the sandbox child.

Order matters for trust: every reference and near-miss output is computed (`prepare`) before the
candidate's module is even imported, on clones of the inputs, and kept on the CPU; inputs are
regenerated from their seed for each candidate call and checked against a checksum taken at
preparation. Each trial then calls the candidate on fresh inputs after poisoning the allocator,
and checks structure, unwritten (poisoned) elements, aliasing, unmodified inputs, numerics,
near-miss distances, determinism (a second run), caching by data pointer (new data in the same
buffers) and input dependence (each tensor input changed alone).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from . import guards
from .numerics import OutputStats, bits_equal, mismatch_count, router_tie_rows

ALT_SEED = 7919  # offset of the seed whose data replaces an input (pointer cache, dependence)


def arg_names(signature: str) -> list[str]:
    """Argument names of a contract SIGNATURE: 'swiglu(gate[T,I] bf16, up[T,I] bf16) -> ...'."""
    inner = signature[signature.index("(") + 1: signature.index(")")]
    parts, depth, cur = [], 0, ""
    for ch in inner:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [re.split(r"[\[:\s=]", p.strip(), maxsplit=1)[0] for p in parts if p.strip()]


def checksum(args: tuple) -> list[int]:
    """Sum and sum of squares of each tensor's bit patterns (chunked: inputs can be GBs)."""
    out = []
    for a in args:
        if not isinstance(a, torch.Tensor):
            out.append(hash(repr(a)))
            continue
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        s1 = s2 = 0
        for chunk in a.contiguous().view(width).flatten().split(1 << 24):
            v = chunk.to(torch.int64)
            s1 += int(v.sum())
            s2 += int((v * v).sum())
        out.extend((s1, s2))
    return out


def as_tuple(outs: Any) -> tuple:
    return tuple(outs) if isinstance(outs, tuple | list) else (outs,)


def snap(outs: Any) -> tuple:
    """CPU copies of the outputs (`.cpu()` of a CPU tensor would be the same tensor)."""
    return tuple(o.detach().to("cpu", copy=True) for o in as_tuple(outs))


def fresh(args: tuple) -> tuple:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def near_misses_for(contract: Any, shape: dict) -> dict[str, Any]:
    """The op's near misses at `shape`; rank-chain near misses apply from 3 ranks up (they
    coincide with the reference at R = 2, see allreduce_norm_residual_norm)."""
    out = dict(contract.numerics.near_misses)
    if shape.get("R", 1) >= 3:
        out.update(getattr(contract.module, "MULTI_RANK_NEAR_MISSES", {}))
    return out


@dataclass
class Prepared:
    """Trusted data for one (shape, seed), computed before the candidate is imported."""

    shape: dict
    seed: int
    first_seed: bool
    sums: list[int]
    ref: tuple
    alt_ref: tuple
    near: dict[str, tuple | str]
    changes_ref: list[int] = field(default_factory=list)  # tensor inputs the reference depends on


def prepare(contract: Any, shape: dict, seed: int, device: str, first_seed: bool,
            dependence: bool | None = None) -> Prepared:
    """References for one trial. `first_seed` trials also run the repeat checks (determinism,
    pointer cache); `dependence` ones (default: the first seed) change each input alone."""
    with torch.no_grad():
        args = contract.make_inputs(shape, seed, device)
        ref = as_tuple(contract.reference(*fresh(args)))
        alt = alt_args(contract, shape, seed, device, args)
        alt_ref = as_tuple(contract.reference(*fresh(alt)))
        near: dict[str, tuple | str] = {}
        for name, fn in near_misses_for(contract, shape).items():
            try:
                near[name] = tuple(t.cpu() for t in as_tuple(fn(*fresh(args))))
            except Exception as e:  # a near miss that cannot run at this shape is reported
                near[name] = f"{type(e).__name__}: {e}"
        changes = []
        if first_seed if dependence is None else dependence:
            for i, a in enumerate(args):
                if isinstance(a, torch.Tensor) and alt[i].shape == a.shape:
                    p = list(fresh(args))
                    p[i] = alt[i].clone()
                    if mismatch_count(as_tuple(contract.reference(*p)), ref):
                        changes.append(i)
    return Prepared(shape=dict(shape), seed=seed, first_seed=first_seed, sums=checksum(args),
                    ref=tuple(t.cpu() for t in ref), alt_ref=tuple(t.cpu() for t in alt_ref),
                    near=near, changes_ref=changes)


def alt_args(contract: Any, shape: dict, seed: int, device: str, args: tuple) -> tuple:
    """Other random data for the tensor inputs; the scalar arguments stay the same."""
    other = contract.make_inputs(shape, seed + ALT_SEED, device)
    return tuple(o if isinstance(a, torch.Tensor) and o.shape == a.shape else a
                 for a, o in zip(args, other, strict=True))


@dataclass
class Findings:
    """First message per failed check, with how many trials failed it."""

    first: dict[str, str] = field(default_factory=dict)
    count: dict[str, int] = field(default_factory=dict)

    def add(self, check: str, message: str) -> None:
        self.first.setdefault(check, message)
        self.count[check] = self.count.get(check, 0) + 1

    def reasons(self) -> list[str]:
        out = []
        for check, msg in self.first.items():
            n = self.count[check] - 1
            out.append(msg + (f" (and {n} more)" if n else ""))
        return out


class TrialRunner:
    def __init__(self, contract: Any, run: Any, config: dict | None, device: str) -> None:
        self.c, self.run, self.config, self.device = contract, run, config, device
        self.names = arg_names(contract.signature)
        self.findings = Findings()
        self.stats: list[OutputStats] = []
        self.output_dtypes: list[torch.dtype] = []
        self.near: dict[str, dict[str, int]] = {}
        self.per_shape: list[dict] = []
        self.router_ties: list[dict] = []
        self.calls = 0

    def _name(self, i: int) -> str:
        return f"{i} ({self.names[i]})" if i < len(self.names) else str(i)

    def _call(self, args: tuple, ref: tuple) -> Any:
        guards.poison_allocator(self.device, [t.numel() * t.element_size() for t in ref])
        self.calls += 1
        with torch.no_grad():
            outs = self.run(*args, config=self.config)
        return outs

    def trial(self, p: Prepared) -> None:
        where = f"at shape {p.shape} seed {p.seed}"
        args = self.c.make_inputs(p.shape, p.seed, self.device)
        if checksum(args) != p.sums:
            self.findings.add("inputs", f"inputs regenerated for the candidate differ from the "
                                        f"prepared ones {where} (torch or make_inputs tampered)")
            return
        pristine = fresh(args)
        try:
            outs = as_tuple(self._side_stream_checked(args, p.ref, where))
        except Exception as e:
            self.findings.add("raised", f"candidate raised {type(e).__name__}: {e} {where}")
            return
        errs = guards.structure_errors(outs, tuple(r.to(self.device) for r in p.ref))
        if errs:
            self.findings.add("structure", f"{errs[0]} {where}")
            return
        self._check_outputs(args, pristine, outs, p, where)
        cpu = snap(outs)
        record = {"shape": p.shape, "seed": p.seed, "outputs": self._numerics(pristine, cpu, p.ref)}
        record["near_miss"] = self._near(cpu, p)
        self.per_shape.append(record)
        if p.first_seed:
            self._repeat_checks(pristine, cpu, p, where)

    def _side_stream_checked(self, args: tuple, ref: tuple, where: str) -> Any:
        outs = self._call(args, ref)
        if not self.device.startswith("cuda"):
            return outs
        # Read the outputs the way a caller does: on the current stream only. Work the
        # candidate left on another stream is not finished yet (or shows up only later).
        snap = tuple(o.clone() for o in as_tuple(outs) if isinstance(o, torch.Tensor))
        torch.cuda.current_stream().synchronize()
        torch.cuda.synchronize()
        now = tuple(o for o in as_tuple(outs) if isinstance(o, torch.Tensor))
        if any(not bool(bits_equal(a, b).all()) for a, b in zip(snap, now, strict=True)):
            self.findings.add("side_stream", f"side-stream work: outputs changed after a "
                                             f"device-wide sync (not ordered on the current "
                                             f"stream) {where}")
        return outs

    def _check_outputs(self, args, pristine, outs, p: Prepared, where: str) -> None:
        for i, (o, r) in enumerate(zip(outs, p.ref, strict=True)):
            oc = o.detach().cpu()
            n = guards.unwritten(oc, r)
            if n:
                self.findings.add("poison", f"output {i} not written (NaN poison survived): {n} "
                                            f"of {o.numel()} elements {where}")
            elif o.numel() > 1 and o.dtype.is_floating_point:
                if bool((oc == 0).all()) and not bool((r == 0).all()):
                    self.findings.add("zeros", f"output {i} is all zeros {where}")
                elif bool(bits_equal(oc, oc.flatten()[0].expand_as(oc)).all()) and \
                        not bool(bits_equal(r, r.flatten()[0].expand_as(r)).all()):
                    self.findings.add("constant", f"output {i} is constant "
                                                  f"({float(oc.flatten()[0])}) {where}")
        inplace = {i: self.names.index(n) for i, n in self.c.inplace.items() if n in self.names}
        for i, j in inplace.items():
            if not guards.same_tensor(outs[i], args[j]):
                self.findings.add("in_place", f"output {i} must be input {self._name(j)} "
                                              f"updated in place (the op's INPLACE) {where}")
        for i, j in guards.aliased(outs, args):
            if inplace.get(i) != j:
                self.findings.add("aliasing", f"output {i} aliases input {self._name(j)} "
                                              f"{where}")
        for j, (a, b) in enumerate(zip(args, pristine, strict=True)):
            if j in inplace.values():
                continue  # an in-place output: compared with the reference's as an output
            if isinstance(a, torch.Tensor) and not bool(bits_equal(a, b).all()):
                self.findings.add("mutation", f"mutated input {self._name(j)} {where}")

    def _numerics(self, args: tuple, cpu: tuple, ref: tuple) -> list[dict]:
        keep = None
        if self.c.name == "router":
            ok, rows = router_tie_rows(tuple(a.cpu() if isinstance(a, torch.Tensor) else a
                                             for a in args), ref[1], cpu[1])
            self.router_ties.extend(rows)
            keep = (~ok)[:, None].expand_as(ref[1])
        while len(self.stats) < len(ref):
            self.stats.append(OutputStats())
            self.output_dtypes.append(ref[len(self.stats) - 1].dtype)
        mags: tuple = (None,) * len(ref)
        if self.c.numerics.magnitude is not None:  # the contract's, on untouched inputs
            with torch.no_grad():
                mags = tuple(m.cpu() for m in as_tuple(self.c.numerics.magnitude(*fresh(args))))
        return [s.add(o, r, keep, m) for s, o, r, m in zip(self.stats, cpu, ref, mags,
                                                            strict=True)]

    def _near(self, cpu: tuple, p: Prepared) -> dict:
        out = {}
        for name, nm in p.near.items():
            self.near.setdefault(name, {"cand_ref": 0, "cand_near": 0, "near_ref": 0,
                                        "trials": 0})
            if isinstance(nm, str):
                out[name] = {"error": nm}
                continue
            d = {"cand_ref": mismatch_count(cpu, p.ref), "cand_near": mismatch_count(cpu, nm),
                 "near_ref": mismatch_count(nm, p.ref)}
            acc = self.near[name]
            for k, v in d.items():
                acc[k] += v
            acc["trials"] += 1
            out[name] = d
        return out

    def _repeat_checks(self, pristine: tuple, first: tuple, p: Prepared, where: str) -> None:
        args2 = fresh(pristine)
        try:
            second = snap(self._call(args2, p.ref))
            if n := mismatch_count(second, first):
                self.findings.add("determinism",
                                  f"nondeterministic: two runs differ in {n} elements {where}")
            alt = alt_args(self.c, p.shape, p.seed, self.device, pristine)
            for a, b in zip(args2, alt, strict=True):
                if isinstance(a, torch.Tensor) and a is not b:
                    a.copy_(b)
            third = snap(self._call(args2, p.alt_ref))
            # The same new data in fresh buffers: a pointer cache answers these two differently
            # (a constant or input-blind candidate answers both alike and is caught elsewhere).
            fourth = snap(self._call(fresh(alt), p.alt_ref))
            stale = not mismatch_count(third, second) and mismatch_count(fourth, second)
            if mismatch_count(p.alt_ref, p.ref) and stale:
                self.findings.add("pointer_cache",
                                  "caches outputs by data pointer: outputs did not follow new "
                                  f"data in the same buffers {where}")
            elif not guards.structure_errors(third, p.alt_ref):
                self._numerics(alt, third, p.alt_ref)
            for i in p.changes_ref:
                args_p = list(fresh(pristine))
                args_p[i] = alt[i].clone()
                if not mismatch_count(snap(self._call(tuple(args_p), p.ref)), first):
                    self.findings.add(f"dependence_{i}",
                                      f"not input dependent: output unchanged when input "
                                      f"{self._name(i)} changed {where}")
        except Exception as e:
            self.findings.add("raised", f"candidate raised {type(e).__name__}: {e} on a repeated "
                                        f"call {where}")
