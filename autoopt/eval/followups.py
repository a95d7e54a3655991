"""Follow-up calls on a case, and the verification burst (see trials.py for the first call).

Each follow-up compares the candidate with itself or with a fresh reference:
    repeat        same content in new buffers: the outputs must be bitwise the first call's;
    same_buffers  new content written into the first call's buffers: the outputs must follow
                  (a cache keyed by data pointer returns the old ones);
    one_element   one element of one floating input changed, in new buffers: the outputs must
                  follow (a cache keyed by a sample of the content returns the old ones);
    dependence    one input replaced wholly: outputs that ignore it do not change;
    shuffled      on CPU, the Triton interpreter runs the kernel's programs in a random order:
                  a result that depends on program order is a cross-program race;
    recheck       the first call's outputs read again after later calls: a buffer the op reuses
                  for its next result changes them.
The burst calls the candidate over many distinct input sets the way timing does (a CUDA graph on
a GPU), writes new content into every set, poisons the burst's outputs and checks a sample.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from . import wire
from .numerics import bits_equal, mismatch_count
from .trials import Case, Judge, refill, shape_key


def _same(a: tuple, b: tuple) -> bool:
    return mismatch_count(a, b) == 0


def repeat(j: Judge, case: Case) -> None:
    where = f"at {case.key} (seed {case.seed})"
    h = j.put(case.args)
    outs = j.call(h, case.ref, where)
    j.drop([h], [j.last_out_id] if outs is not None else [])
    if outs is not None and (n := mismatch_count(outs, case.first)):
        j.findings.add("determinism", f"nondeterministic: two runs differ in {n} elements "
                                      f"{where}")


_STATE_FULL_BYTES = 256 << 20


def keeps_state(j: Judge, case: Case, seed: int) -> None:
    """What the candidate keeps between calls (worker_state.py) must be what the inputs of its
    last call determine. Twice: after two calls on the case's held inputs, and after new data
    (drawn from `seed`, never seen before) then the case's own again in the same buffers. A
    count of calls changes on every call; a count of calls whose inputs changed, or a record
    of the inputs seen, changes in the second. Either can make a kernel exact for as many calls
    as a verification makes and wrong after."""
    where = f"at {case.key} (seed {case.seed})"
    held = [i for i, a in enumerate(case.args) if isinstance(a, torch.Tensor)]
    restore = sorted(set(j.inplace.values()))  # inputs the op updates: back before each call

    def call_with(args: tuple, ref: tuple, rewrite: list[int]) -> bool:
        for i in rewrite:
            j.write(case.handle, i, args[i])
        outs = j.call(case.handle, ref, where)
        if outs is None:
            return False
        j.drop([], [j.last_out_id])
        if args is not case.args:  # judged, out of the bias test as other follow-ups' calls
            j.record(case.key, args, outs, ref, bias=False)
        return True

    def digest() -> dict:
        return j._checked(j.w.request({"cmd": "state"}))["digest"]

    entry = {"case": case.key, "names": 0, "comparisons": 0, "changed": []}
    j.state_checks.append(entry)
    if not call_with(case.args, case.ref, restore):
        return
    first = digest()
    entry["names"] = len(first)
    if not call_with(case.args, case.ref, restore):
        return
    again = digest()
    _state_finding(j, first, again, f"after two calls on the same inputs {where}", entry)
    # New data in every input; where the inputs are large (a MoE rank's expert weights), only in
    # those with a row per token, which are what changes from one served call to the next.
    new = refill(case.args, j.c.make_inputs(dict(case.shape), seed, j.device))
    t = case.args[0].shape[j.c.token_dim] if held and held[0] == 0 else -1
    size = sum(case.args[i].numel() * case.args[i].element_size() for i in held)
    changing = [i for i in held if new[i] is not case.args[i] and (
        size <= _STATE_FULL_BYTES or (case.args[i].dim() >= 1 and case.args[i].shape[0] == t))]
    if not changing:
        return
    new = tuple(new[i] if i in changing else a for i, a in enumerate(case.args))
    ok = call_with(new, j.reference(new), changing)
    if ok and call_with(case.args, case.ref, changing):
        _state_finding(j, again, digest(), f"after a call on other data in the same buffers "
                                           f"and one on the same inputs again {where}", entry)
    elif not ok:  # the case's buffers hold its own data again
        for i in changing:
            j.write(case.handle, i, case.args[i])


def _state_finding(j: Judge, a: dict, b: dict, how: str, entry: dict) -> None:
    entry["comparisons"] += 1
    if "<too many objects>" in b:
        j.findings.add("state", f"keeps more than {b['<too many objects>']} objects between "
                                "calls: too many to check that they do not change")
        return
    changed = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    entry["changed"] += [k for k in changed if k not in entry["changed"]]
    if changed:
        names = ", ".join(changed[:4]) + (f" and {len(changed) - 4} more" if len(changed) > 4
                                           else "")
        j.findings.add("state", f"keeps state that changes from call to call: {names} differed "
                                f"{how} (state that counts calls or remembers inputs can make "
                                "a kernel exact for as many calls as a verification makes and "
                                "wrong after)")


def same_buffers(j: Judge, case: Case) -> None:
    where = f"at {case.key} (seed {case.seed})"
    alt = j.alt_args(case)
    for i, (a, b) in enumerate(zip(case.args, alt, strict=True)):
        if isinstance(a, torch.Tensor):
            j.write(case.handle, i, b)
    ref = j.reference(alt)
    outs = j.call(case.handle, ref, where)
    if outs is None:
        return
    j.drop([], [j.last_out_id])
    if not _same(ref, case.ref) and _same(outs, case.first):
        j.findings.add("pointer_cache", "caches outputs by data pointer: outputs did not follow "
                                        f"new data in the same buffers {where}")
    else:
        j.record(case.key, alt, outs, ref)
    for i, a in enumerate(case.args):  # the case's buffers hold its own data again
        if isinstance(a, torch.Tensor):
            j.write(case.handle, i, a)


def changing_inputs(j: Judge, case: Case) -> list[int]:
    """Tensor inputs whose replacement changes the reference's outputs."""
    alt = j.alt_args(case)
    out = []
    for i, (a, b) in enumerate(zip(case.args, alt, strict=True)):
        if isinstance(a, torch.Tensor) and a is not b:
            p = list(case.args)
            p[i] = b
            if not _same(j.reference(tuple(p)), case.ref):
                out.append(i)
    return out


def dependence(j: Judge, case: Case, i: int) -> None:
    where = f"at {case.key} (seed {case.seed})"
    p = list(case.args)
    p[i] = j.alt_args(case)[i]
    ref = j.reference(tuple(p))
    h = j.put(tuple(p))
    outs = j.call(h, ref, where)
    j.drop([h], [j.last_out_id] if outs is not None else [])
    if outs is None:
        return
    if _same(outs, case.first):
        j.findings.add(f"dependence_{i}", f"not input dependent: output unchanged when input "
                                          f"{j._name(i)} changed {where}")
    else:  # one input or one element changed: the rest repeats the case's errors
        j.record(case.key, tuple(p), outs, ref, bias=False)


def one_element(j: Judge, case: Case, i: int, rng: Any) -> None:
    """Change one element of floating input i (where the reference notices) and call again."""
    a = case.args[i]
    if not (isinstance(a, torch.Tensor) and a.dtype.is_floating_point and a.numel()):
        return
    alt = j.alt_args(case)[i]
    for _ in range(4):
        k = rng.randrange(a.numel())
        changed = a.clone()
        flat = changed.view(-1)
        new = alt.reshape(-1)[k]
        flat[k] = new if not bool(bits_equal(new, flat[k])) else flat[k] * 2 + 1
        p = list(case.args)
        p[i] = changed
        ref = j.reference(tuple(p))
        if not _same(ref, case.ref):
            break
    else:
        return  # no element of this input moved the reference (masked or saturated)
    where = f"at {case.key} (seed {case.seed}, input {j._name(i)} element {k} changed)"
    h = j.put(tuple(p))
    outs = j.call(h, ref, where)
    j.drop([h], [j.last_out_id] if outs is not None else [])
    if outs is None:
        return
    if _same(outs, case.first):
        j.findings.add("content_cache", "caches outputs by content: outputs did not follow a "
                                        f"one-element change of the input {where}")
    else:  # one input or one element changed: the rest repeats the case's errors
        j.record(case.key, tuple(p), outs, ref, bias=False)


def shuffled(j: Judge, case: Case, order: str) -> None:
    """A natural-order call, then one with the programs in `order`: a difference that only the
    shuffled call shows is a race; one the natural call shows too is plain nondeterminism."""
    where = f"at {case.key} (seed {case.seed}, programs in {order} order)"
    natural = j.call(case.handle, case.ref, where)
    if natural is None:
        return
    j.drop([], [j.last_out_id])
    outs = j.call(case.handle, case.ref, where, order=order)
    if outs is None:
        return
    j.drop([], [j.last_out_id])
    n_natural, n = mismatch_count(natural, case.first), mismatch_count(outs, case.first)
    if n and not n_natural and j.last_reply.get("permuted_launches"):
        j.findings.add("races", f"races: the result depends on the order of the kernel's "
                                f"programs ({n} elements differ) {where}: a cross-program race")
    elif n or n_natural:
        j.findings.add("determinism", f"nondeterministic: two runs differ in "
                                      f"{max(n, n_natural)} elements {where}")


def recheck(j: Judge, case: Case) -> None:
    where = f"at {case.key} (seed {case.seed})"
    expect = j.expect(case.ref)
    reply = j._checked(j.w.request({"cmd": "export", "out": case.out_id, "expect": expect,
                                    "region": {"off": 0, "cap": j.w.arena.size}}))
    now = j.w.unpack(reply["data"], expect)
    for i, (a, b) in enumerate(zip(now, case.first, strict=True)):
        if i in j.inplace:
            continue  # the input buffer itself: later calls on the case rewrite it by design
        if a is None or not bool(bits_equal(a.to(b.device), b).all()):
            j.findings.add("stay_put", f"outputs changed after later calls: output {i} of the "
                                       f"call {where} was overwritten (a buffer the op reuses)")
            break
    j.drop([], [case.out_id])


def marathon(j: Judge, shape: dict, seeds: list[int], calls: int, time_s: float,
             max_bytes: int | None = None) -> dict:
    """The candidate called on a few input sets in turn, `calls` times or for `time_s` seconds,
    whichever ends first, its outputs dropped: what it does after that many calls is what the
    judged calls after the marathon see (a candidate exact for its first N calls, the number a
    verifier was expected to make, is past N by then). The inputs are the op's own draws; the
    count comes back from the worker, and the judge's own clock bounds the request. With
    `max_bytes`, as many sets as fit in it (at least one: a MoE rank's set is ~9 GiB)."""
    handles = []
    for k, seed in enumerate(seeds):
        args = j.c.make_inputs(dict(shape), seed, j.device)
        handles.append(j.put(args, judged=False))
        size = sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))
        del args
        if max_bytes is not None and size * (k + 2) > max_bytes:
            break
    t0 = time.perf_counter()
    reply = j._checked(j.w.request({"cmd": "marathon", "handles": handles, "calls": int(calls),
                                    "time_s": float(time_s)}, timeout=4 * time_s + 60))
    info = {"shape": shape_key(shape), "sets": len(handles), "asked_calls": int(calls),
            "asked_s": round(time_s, 2),
            "calls": int(reply.get("calls", 0)), "wall_s": round(time.perf_counter() - t0, 2)}
    if "raised" in reply:
        j.findings.add("raised", f"candidate raised {reply['raised']} in a marathon of calls at "
                                 f"{shape_key(shape)} (call {reply.get('calls', 0) + 1})")
    j.calls += info["calls"]
    j.drop(handles)
    return info


def burst(j: Judge, shape: dict, seeds: list[int], reps: int, samples: list[int],
          max_bytes: int | None = None) -> dict:
    """Many calls over distinct sets (a graph on cuda); refresh; poison; replay; check. With
    `max_bytes`, as many sets as fit in it (at least two; samples folded onto them)."""
    first = j.c.make_inputs(dict(shape), seeds[0], j.device)
    size = sum(a.numel() * a.element_size() for a in first if isinstance(a, torch.Tensor))
    bounded = max_bytes is not None and size * len(seeds) > max_bytes
    if bounded:
        n = max(2, max_bytes // max(size, 1))
        seeds, samples = seeds[:n], sorted({k % n for k in samples})
    key = "burst " + shape_key(shape)
    where = f"in a burst of {len(seeds)} input sets x {reps} at {shape_key(shape)}"
    # One set at a time on the judge's side: each is handed over, and only what the checks
    # need stays here (the sampled sets' stale references, every set's scalars and layout).
    handles, stale, skeletons = [], {}, []
    for k, seed in enumerate(seeds):
        args = first if k == 0 else j.c.make_inputs(dict(shape), seed, j.device)
        first = None
        handles.append(j.put(args, judged=False))  # only a sample is judged
        if k in samples:
            stale[k] = j.reference(args)
        skeletons.append(tuple(torch.empty(a.shape, dtype=a.dtype, device="meta")
                               if isinstance(a, torch.Tensor) else a for a in args))
        del args
    reply = j._checked(j.w.request({"cmd": "burst_setup", "handles": handles, "reps": reps,
                                    "warmup": 1, "graph": True}))
    info = {"graph": reply.get("graph"), "note": reply.get("note"), "sets": len(seeds),
            "set_bytes": size, "bounded_by_memory": bounded}
    if "raised" in reply:
        j.findings.add("raised", f"candidate raised {reply['raised']} {where}")
        j.drop(handles)
        return info
    fresh_sets = {}
    for k, (h, old, seed) in enumerate(zip(handles, skeletons, seeds, strict=True)):
        new = refill(old, j.c.make_inputs(dict(shape), seed + 2 * 7919, j.device))
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            if a is not b and isinstance(a, torch.Tensor):
                j.write(h, i, b)
        if k in samples:
            fresh_sets[k] = new
    j.w.request({"cmd": "burst_poison"})
    run = j._checked(j.w.request({"cmd": "burst_run", "replays": 1}))
    if "raised" in run:
        j.findings.add("raised", f"candidate raised {run['raised']} {where}")
        j.drop(handles, burst=True)
        return info
    _check_burst_outputs(j, key, where, handles, stale, fresh_sets, samples)
    j.calls += run.get("calls_per_sample", 0)
    j.drop(handles, burst=True)
    return info


def _check_burst_outputs(j: Judge, key: str, where: str, handles: list[int], stale_refs: dict,
                         new: dict, samples: list[int]) -> None:
    refs = [j.reference(new[k]) for k in samples]
    expect = [j.expect(r) for r in refs]
    j.w.ensure(sum(wire.aligned(t.numel() * t.element_size()) for r in refs for t in r) + 8192)
    reply = j._checked(j.w.request({"cmd": "burst_export", "indices": samples, "expect": expect,
                                    "region": {"off": 0, "cap": j.w.arena.size}}))
    for k, ref, exp, descs in zip(samples, refs, expect, reply["data"], strict=True):
        outs = j.w.unpack(descs, exp)
        if any(o is None for o in outs):
            j.findings.add("burst", f"burst: call {k} returned no well-formed outputs {where}")
            continue
        outs = tuple(o.to(j.device) for o in outs)
        stale = stale_refs[k]
        if not _same(stale, ref) and _same(outs, stale):
            j.findings.add("burst", f"burst: outputs of replayed calls did not follow new "
                                    f"inputs (cached, not recomputed) {where}")
            continue
        j._written(outs, ref, where)
        j.record(key, new[k], outs, ref)
