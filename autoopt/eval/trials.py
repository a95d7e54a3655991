"""The judge's trials: inputs and references in the judge, calls in the worker, judgement here.

A `Case` is one input set (a shape, a secret seed, maybe an edge case) with its reference and
near-miss outputs, computed in the judge on the judge's own copies. `Judge.first_call` hands
the inputs to the worker, calls the candidate, reads the outputs back as copies and checks
structure, unwritten (poisoned) elements, aliasing, mutation of inputs, numerics and near-miss
distances per shape. Follow-up calls on a case check determinism (same content, new buffers),
pointer caching (new content, same buffers), content caching (one element changed), input
dependence (one input replaced), program order (the interpreter runs the programs shuffled) and
that earlier outputs stay put after later calls. Findings keep the first message per check.
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from . import wire
from .channel import Worker, WorkerError
from .numerics import (
    OutputStats,
    align_tied_slots,
    bits_equal,
    mismatch_count,
    router_tie_rows,
    ulp_distance,
)

ALT_OFFSET = 7919  # seed offset of the data that replaces an input
# The layouts a put hands an input over in (see `Judge.put`), four in eleven contiguous; the others
# rows a few elements apart, rows one or two row lengths apart (serving's column slices of one
# projection), or the first rows of a larger allocation (a CUDA graph's static buffers, which is
# how serving hands over nearly every decode input, so three in eleven). Dealt from a shuffled
# deck of these, so every run of as many puts holds each: drawn at random, a run could miss one.
LAYOUTS = ("contiguous",) * 4 + ("elements", "row", "rows") + ("tail",) * 3
# How much larger than the input a "tail" layout's allocation is, dealt from a deck of its own:
# a few rows more (an allocation rounded up), 1.1x to 4x the input, or 4x to 512x (a graph's
# buffers sized for the largest batch, with a decode batch in their first rows: half the deck).
# Any three deals hold the last class, so a run that deals three tails meets it.
TAIL_SIZES = ("few", "several", "many", "many")
SPENT = ("inputs", "reference", "near_misses", "transfers", "calls")
TAIL_MAX_ELEMENTS = 1 << 24  # the "many" class's cap on the allocation's extra elements


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


def pair_keys(t: torch.Tensor) -> torch.Tensor:
    """int64 keys of each run of neighbouring elements of a flat float tensor: three 16-bit
    patterns (BF16/FP16; a data-like palette repeats pairs of common values) or two 32-bit ones.
    Key k covers elements k .. k+2 (16-bit) or k .. k+1 (32-bit)."""
    bits = 8 * t.element_size()
    width = {16: torch.int16, 32: torch.int32}[bits]
    b = t.contiguous().view(width).flatten().to(torch.int64) & ((1 << bits) - 1)
    if bits == 16:
        return (b[:-2] << 32) | (b[1:-1] << 16) | b[2:]
    return (b[:-1] << 32) | b[1:]


def run_mask(differ: torch.Tensor, element_size: int) -> torch.Tensor:
    """Which keys of `pair_keys` cover only differing elements."""
    if element_size == 2:
        return differ[:-2] & differ[1:-1] & differ[2:]
    return differ[:-1] & differ[1:]


def refill(old: tuple, new: tuple) -> tuple:
    """`new`'s tensors where they fit `old`'s buffers, `old`'s scalars (which stay in the worker
    when new content is written into held buffers)."""
    return tuple(b if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                 and a.shape == b.shape and a.dtype == b.dtype else a
                 for a, b in zip(old, new, strict=True))


def as_tuple(outs: Any) -> tuple:
    return tuple(outs) if isinstance(outs, tuple | list) else (outs,)


def fresh(args: tuple) -> tuple:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def shape_key(shape: dict, edge: str | None = None) -> str:
    text = ",".join(f"{k}={v}" for k, v in shape.items())
    return f"{edge} {text}" if edge else text


def near_misses_for(contract: Any, shape: dict) -> dict[str, Any]:
    """The op's near misses at `shape`; rank-chain near misses apply from 3 ranks up (they
    coincide with the reference at R = 2, see allreduce_norm_residual_norm)."""
    out = dict(contract.numerics.near_misses)
    if shape.get("R", 1) >= 3:
        out.update(getattr(contract.module, "MULTI_RANK_NEAR_MISSES", {}))
    return out


@dataclass
class Case:
    key: str
    shape: dict
    seed: int
    edge: str | None
    args: tuple
    ref: tuple
    near: dict[str, tuple | str]
    handle: int | None = None
    out_id: int | None = None
    first: tuple | None = None  # the candidate's outputs of its first call (judge copies)
    alt: tuple | None = None  # other random data for its inputs, drawn once (see alt_args)


@dataclass
class Findings:
    """First message per failed check, with how many times it failed."""

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


class Judge:
    """Runs calls on one worker for one op and keeps the per-shape evidence."""

    def __init__(self, contract: Any, worker: Worker, device: str, palette_set: dict,
                 rng: Any = None) -> None:
        self.c, self.w, self.device = contract, worker, device
        self.rng = rng  # with one, some puts hand over row-padded views (see `put`)
        self.names = arg_names(contract.signature)
        # Outputs that are inputs updated in place (the KV cache): output index -> input index.
        self.inplace = {i: self.names.index(n) for i, n in contract.inplace.items()
                        if n in self.names}
        self.findings = Findings()
        self.stats: dict[tuple[str, int], OutputStats] = {}
        self.dtypes: dict[int, torch.dtype] = {}
        self.near: dict[tuple[str, str], dict[str, int]] = {}
        self.per_shape: list[dict] = []
        self.router_ties: list[dict] = []
        self.skipped: list[str] = []
        self.palette_set = palette_set  # dtype -> set of poison bit patterns
        self.calls = 0
        # Seconds by kind of work (inputs drawn, reference, near misses, transfers to the worker,
        # candidate calls with their outputs back): where a slow judge spends its time.
        self.spent: dict[str, float] = dict.fromkeys(SPENT, 0.0)
        self.by_step: dict[str, float] = {}  # wall seconds by step kind (session.run_steps)
        self.marathon: dict[str, Any] = {}  # what the run's marathon did (followups.marathon)
        self.state_checks: list[dict] = []  # followups.keeps_state: the cases, what was digested
        self._ids = 0
        self._alt_case: Case | None = None  # the one case whose `alt` is kept
        # LAYOUTS left to deal, by "two rows or more"; and TAIL_SIZES left, under "tail"
        self._decks: dict[bool | str, list[str]] = {}

    # ---- cases --------------------------------------------------------------------------------
    def make_case(self, shape: dict, seed: int, edge: Any = None) -> Case | None:
        """Inputs, reference and near misses; None where the contract defines no answer."""
        name = getattr(edge, "name", None)
        try:
            with torch.no_grad(), self._spend("inputs"):
                args = (edge.inputs(self.c.make_inputs, seed, self.device) if edge else
                        self.with_outliers(self.c.make_inputs(dict(shape), seed, self.device)))
            with torch.no_grad(), self._spend("reference"):
                ref = as_tuple(self.c.reference(*fresh(args)))
        except Exception as e:  # noqa: BLE001 - the contract does not define this input
            self.skipped.append(f"{shape_key(shape, name)}: {type(e).__name__}: {e}")
            return None
        near: dict[str, tuple | str] = {}
        for nm, fn in near_misses_for(self.c, shape).items():
            try:
                with torch.no_grad(), self._spend("near_misses"):
                    near[nm] = as_tuple(fn(*fresh(args)))
            except Exception as e:  # noqa: BLE001 - a near miss that cannot run here
                near[nm] = f"{type(e).__name__}: {e}"
        return Case(shape_key(shape, name), dict(shape), seed, name, args, ref, near)

    def with_outliers(self, args: tuple) -> tuple:
        """With an rng, half of the cases get activations like a served model's: about one
        channel in 64 of each input the contract may scale (its "huge" edge case) multiplied by
        8 or 32 (a power of two: no value is rounded; never past the contract's own factor), so
        Gaussian-looking data is no sign of being verified."""
        huge = self.c.tests.edge_scales.get("huge", {})
        if not huge or self.rng is None or self.rng.random() >= 0.5:
            return args
        out = list(args)
        for i, limit in huge.items():
            a = out[i] if i < len(out) else None
            if not (isinstance(a, torch.Tensor) and a.is_floating_point() and a.dim() >= 1
                    and a.numel()):
                continue
            factor = min(float(limit), float(self.rng.choice((8, 32))))
            if factor <= 1.0:
                continue
            n = a.shape[-1]
            cols = torch.tensor(self.rng.sample(range(n), max(1, n // 64)), device=a.device)
            b = a.clone()
            b[..., cols] *= factor
            out[i] = b
        return tuple(out)

    def alt_args(self, case: Case) -> tuple:
        """Other random data for the tensor inputs (same shapes); scalars stay. Kept for the
        case that asked last (a follow-up asks once per input, and a MoE rank's inputs are
        ~9 GiB and take seconds to draw); the callers copy before they write."""
        if case.alt is None:
            if self._alt_case is not None:  # one case's alternative kept at a time (memory)
                self._alt_case.alt = None
            self._alt_case = case
            other = self.c.make_inputs(dict(case.shape), case.seed + ALT_OFFSET, self.device)
            case.alt = tuple(o if isinstance(a, torch.Tensor) and o.shape == a.shape else a
                             for a, o in zip(case.args, other, strict=True))
        return case.alt

    def reference(self, args: tuple) -> tuple:
        with torch.no_grad():
            return as_tuple(self.c.reference(*fresh(args)))

    @contextlib.contextmanager
    def _spend(self, kind: str):
        """Adds the block's seconds to `spent[kind]` (synchronised: GPU work is counted where it
        was queued, not where the next sync waits for it)."""
        if self.device.startswith("cuda"):
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.device.startswith("cuda"):
                torch.cuda.synchronize(self.device)
            self.spent[kind] += time.perf_counter() - t0

    # ---- worker calls -------------------------------------------------------------------------
    def _next(self) -> int:
        self._ids += 1
        return self._ids

    def put(self, args: tuple, judged: bool = True) -> int:
        """Hand `args` to the worker. Serving passes views whose rows are farther apart than
        their length (q, k and gate split from one projection, the two halves of a GEMM): with
        an rng, seven puts in eleven hand every tensor that starts with the token axis over as such
        a view (a few elements, or one or two row lengths apart), or as the first rows of a
        larger allocation (serving's CUDA graphs slice ids, positions, slots and page tables out
        of buffers sized for the largest batch; `TAIL_SIZES`), so neither a contiguous layout
        nor a layout like serving's is a sign of being verified or not. The layouts are dealt
        (`LAYOUTS`), from one deck for puts of two rows or more and another for the rest, so
        every run judges each layout on inputs of several rows; `judged=False` (the burst's
        sets, of which only a sample is judged) draws one at random and leaves the deal to
        calls that are judged."""
        h = self._next()
        with self._spend("transfers"):
            return self._put(h, args, judged)

    def _put(self, h: int, args: tuple, judged: bool) -> int:
        descs = self.w.pack(args)
        t = args[0].shape[self.c.token_dim] if isinstance(args[0], torch.Tensor) else -1
        layout = "contiguous" if self.rng is None else \
            self._deal(t >= 2) if judged else self.rng.choice(LAYOUTS)
        if layout != "contiguous":
            # A few elements (an aligned allocation), or whole rows: serving's q, k, v and gate
            # are column slices of one projection, rows one or more row lengths apart. Or a
            # prefix: 7 to 511 rows more in the allocation, as a graph's static buffers have.
            pad = self.rng.choice((3, 64)) if layout == "elements" else layout
            tail = self._tail_rows(t, args[0]) if pad == "tail" else 0
            for d, a in zip(descs, args, strict=True):
                if pad == "tail":
                    if isinstance(a, torch.Tensor) and a.dim() >= 1 and a.shape[0] == t > 0:
                        d["tail"] = tail
                    continue
                if isinstance(a, torch.Tensor) and a.dim() >= 2 and a.shape[0] == t > 0:
                    row = a[0].numel()
                    d["pad"] = row if pad == "row" else 2 * row if pad == "rows" else pad
                    if pad in ("row", "rows"):
                        # Which slice of the projection: the first, or one starting a row (or
                        # two) in, whose address is not the allocation's.
                        d["offset"] = row * self.rng.randint(0, 1 if pad == "row" else 2)
        self._checked(self.w.request({"cmd": "put", "handle": h, "args": descs}))
        return h

    def _tail_rows(self, t: int, first: Any) -> int:
        """Rows a "tail" layout's allocation holds beyond the input's `t` (`TAIL_SIZES`)."""
        deck = self._decks.setdefault("tail", [])
        if not deck:
            deck += TAIL_SIZES
            self.rng.shuffle(deck)
        size = deck.pop()
        if size == "few":
            return self.rng.choice((1, 7, 63))
        if size == "several":
            return max(1, int(t * self.rng.uniform(0.1, 3.0)))
        # "many": at least 3 t rows more, up to 511 t, unless the cap on elements binds
        row = max(1, first[0].numel()) if isinstance(first, torch.Tensor) and t > 0 else 1
        ratio = 2.0 ** self.rng.uniform(2.0, 9.0)  # the allocation is 4x to 512x the input
        return max(1, min(int(t * ratio) - t, TAIL_MAX_ELEMENTS // row))

    def _deal(self, several_rows: bool) -> str:
        deck = self._decks.setdefault(several_rows, [])
        if not deck:
            deck += LAYOUTS
            self.rng.shuffle(deck)
        return deck.pop()

    def write(self, handle: int, index: int, t: torch.Tensor) -> None:
        (d,) = self.w.pack([t])
        self._checked(self.w.request({"cmd": "write", "handle": handle, "index": index,
                                      "data": d}))

    def drop(self, handles: list[int] = (), outs: list[int] = (), burst: bool = False) -> None:
        self.w.request({"cmd": "drop", "handles": list(handles), "outs": list(outs),
                        "burst": burst})

    def _checked(self, reply: dict) -> dict:
        if "error" in reply:
            raise WorkerError("protocol", f"worker error: {reply['error']}")
        return reply

    @staticmethod
    def expect(ref: tuple) -> list[dict]:
        return [{"dtype": wire.DTYPE_NAMES[r.dtype], "shape": list(r.shape)} for r in ref]

    def call(self, handle: int, ref: tuple, where: str, order: str = "natural") -> tuple | None:
        """Call the candidate on held inputs; its outputs as judge copies, or None (recorded)."""
        expect = self.expect(ref)
        self.w.ensure(sum(wire.aligned(r.numel() * r.element_size()) for r in ref) + 4096)
        out_id = self._next()
        with self._spend("calls"):
            reply = self._checked(self.w.request({
                "cmd": "call", "handle": handle, "out": out_id, "expect": expect,
                "region": {"off": 0, "cap": self.w.arena.size}, "order": order,
                "order_seed": self._ids}))
        self.calls += 1
        self.last_reply = reply
        if "raised" in reply:
            self.findings.add("raised", f"candidate raised {reply['raised']} {where}")
            return None
        errs = self._structure(reply, ref)
        if errs:
            self.findings.add("structure", f"{errs[0]} {where}")
            return None
        for i, o in enumerate(reply["outputs"]):
            for j in o.get("aliases_inputs", []):
                if self.inplace.get(i) != j:
                    self.findings.add("aliasing", f"output {i} aliases input {self._name(j)} "
                                                  f"{where}")
            if i in self.inplace and self.inplace[i] not in o.get("is_input", []):
                self.findings.add("in_place", f"output {i} must be input "
                                              f"{self._name(self.inplace[i])} updated in place "
                                              f"(the op's INPLACE) {where}")
        outs = self.w.unpack(reply["data"], expect)
        if any(o is None for o in outs):
            raise WorkerError("protocol", "worker did not copy outputs it reported well-formed")
        self.last_out_id = out_id
        return tuple(o.to(self.device) for o in outs)

    def _structure(self, reply: dict, ref: tuple) -> list[str]:
        if reply.get("count") != len(ref):
            return [f"wrong dtype/shape: returned {reply.get('count')} outputs, expected "
                    f"{len(ref)}"]
        errs = []
        for i, (o, r) in enumerate(zip(reply["outputs"], ref, strict=True)):
            want = (wire.DTYPE_NAMES[r.dtype], list(r.shape))
            if not o.get("plain"):
                errs.append(f"wrong dtype/shape: output {i} is {o.get('type')}, expected a plain "
                            f"torch.Tensor")
            elif (o.get("dtype"), o.get("shape")) != want:
                errs.append(f"wrong dtype/shape: output {i} is {o.get('dtype')} "
                            f"{o.get('shape')}, expected {want[0]} {want[1]}")
            elif torch.device(o.get("device", "?")).type != torch.device(self.device).type:
                errs.append(f"wrong dtype/shape: output {i} is on {o.get('device')}, expected "
                            f"{self.device}")
        return errs

    def _name(self, i: int) -> str:
        return f"{i} ({self.names[i]})" if i < len(self.names) else str(i)

    # ---- the first call of a case -------------------------------------------------------------
    def first_call(self, case: Case) -> None:
        where = f"at {case.key} (seed {case.seed})"
        case.handle = self.put(case.args)
        outs = self.call(case.handle, case.ref, where)
        if outs is None:
            return
        case.out_id, case.first = self.last_out_id, outs
        self._mutation(case, where)
        self._written(outs, case.ref, where)
        record = {"shape": case.shape, "edge": case.edge, "seed": case.seed,
                  "outputs": self.record(case.key, case.args, outs, case.ref),
                  "near_miss": self._near(case, outs)}
        self.per_shape.append(record)

    def _mutation(self, case: Case, where: str) -> None:
        sizes = sum(wire.aligned(a.numel() * a.element_size()) for a in case.args
                    if isinstance(a, torch.Tensor))
        self.w.ensure(sizes + 4096)
        reply = self._checked(self.w.request({"cmd": "readback", "handle": case.handle,
                                              "region": {"off": 0, "cap": self.w.arena.size}}))
        expect = [self.expect((a,))[0] if isinstance(a, torch.Tensor) else None
                  for a in case.args]
        for j, (d, a) in enumerate(zip(reply["data"], case.args, strict=True)):
            if not isinstance(a, torch.Tensor) or j in self.inplace.values():
                continue  # an in-place output is judged as an output
            (now,) = self.w.unpack([d], [expect[j]])
            if now is None or not bool(bits_equal(now.to(a.device), a).all()):
                self.findings.add("mutation", f"mutated input {self._name(j)} {where}")

    def _written(self, outs: tuple, ref: tuple, where: str) -> None:
        for i, (o, r) in enumerate(zip(outs, ref, strict=True)):
            if not o.dtype.is_floating_point or o.numel() == 0:
                continue
            differ = (~bits_equal(o, r)).flatten()
            pairs = run_mask(differ, o.element_size()) if o.element_size() in (2, 4) else None
            n_pairs = int(pairs.sum()) if pairs is not None and pairs.numel() else 0
            keys = self.palette_set.get(o.dtype)
            if n_pairs and keys is not None:
                hit = torch.isin(pair_keys(o)[pairs], keys.to(o.device))
                poisoned = int(hit.sum())
                if poisoned and poisoned * 2 >= n_pairs:
                    self.findings.add("poison", f"output {i} not written (poison survived): "
                                                f"about {poisoned + 2} of {o.numel()} elements "
                                                f"{where}")
                    continue
            if o.numel() > 1 and bool((o == 0).all()) and not bool((r == 0).all()):
                self.findings.add("zeros", f"output {i} is all zeros {where}")
            elif o.numel() > 1 and bool(bits_equal(o, o.flatten()[0].expand_as(o)).all()) and \
                    not bool(bits_equal(r, r.flatten()[0].expand_as(r)).all()):
                self.findings.add("constant", f"output {i} is constant "
                                              f"({float(o.flatten()[0])}) {where}")

    def record(self, key: str, args: tuple, outs: tuple, ref: tuple,
               bias: bool = True) -> list[dict]:
        """Fold one call's outputs into the per-shape statistics of `key` (`bias=False`: its
        inputs are a near copy of an earlier call's, left out of the bias test)."""
        keep = None
        if self.c.name == "router":
            # Rows whose ids differ only across an FP32 tie: the same experts in another slot
            # order are compared in the reference's order; a set changed across a tie is not
            # compared (weights follow the set), in either output.
            ok, rows = router_tie_rows(args, ref[1], outs[1])
            self.router_ties.extend(rows)
            outs, ok = align_tied_slots(ref, outs, ok)
            keep = (~ok)[:, None].expand_as(ref[1])
        mags: tuple = (None,) * len(ref)
        if getattr(self.c.numerics, "magnitude", None) is not None:
            # The contract's error scale (moe_experts: the combined terms' size), on the inputs.
            with torch.no_grad():
                mags = tuple(m.cpu() for m in as_tuple(self.c.numerics.magnitude(*fresh(args))))
            if torch.cuda.is_available():
                # A prefill attention's scale takes two reference-sized passes in blocks: their
                # cached blocks would leave the next reference's [Hq, T, S] softmax no room.
                torch.cuda.empty_cache()
        out = []
        for i, (o, r, m) in enumerate(zip(outs, ref, mags, strict=True)):
            self.dtypes.setdefault(i, r.dtype)
            stats = self.stats.setdefault((key, i), OutputStats())
            out.append(stats.add(o, r, keep if i < 2 else None, m, bias))
        return out

    def _near(self, case: Case, outs: tuple) -> dict:
        out = {}
        for name, nm in case.near.items():
            acc = self.near.setdefault((case.key, name), {
                "cand_ref": 0, "cand_near": 0, "near_ref": 0, "cand_ref_ulps": 0,
                "cand_near_ulps": 0, "near_ref_ulps": 0, "trials": 0})
            if isinstance(nm, str):
                out[name] = {"error": nm}
                continue
            d = {"cand_ref": mismatch_count(outs, case.ref), "cand_near": mismatch_count(outs, nm),
                 "near_ref": mismatch_count(nm, case.ref),
                 "cand_ref_ulps": ulp_distance(outs, case.ref),
                 "cand_near_ulps": ulp_distance(outs, nm),
                 "near_ref_ulps": ulp_distance(nm, case.ref)}
            for k, v in d.items():
                acc[k] += v
            acc["trials"] += 1
            out[name] = d
        return out
