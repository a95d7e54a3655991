"""The worker's bursts: many calls over many input sets, replayed as one CUDA graph on a GPU.

Timing runs a burst, and verification runs the same burst and checks a sample of its outputs, so
a candidate cannot tell the two apart by how it is called. On cuda `setup` warms the candidate up
and captures `reps` passes over the input sets into one graph (eagerly when capture fails,
noted); `run` replays it and reports CUDA-event times per replay (the judge checks them against
its own wall clock); `poison` overwrites the graph's outputs so a replay that does not rewrite
them shows; `export` copies a sample of the last pass's outputs to the arena. On CPU the burst
is a loop of eager calls timed with the perf counter (not meaningful for speed).

The timers and graph types are bound when this module is imported, before the candidate is.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .worker import _as_tuple, _region, _State, _text, _write_outputs, call_config, palette_tile

_perf = time.perf_counter
_Event = torch.cuda.Event
_CUDAGraph = torch.cuda.CUDAGraph
_graph = torch.cuda.graph
_Stream = torch.cuda.Stream
_use_stream = torch.cuda.stream
_current_stream = torch.cuda.current_stream
_synchronize = torch.cuda.synchronize
_type = type


def setup(state: _State, msg: dict, fds: list) -> dict:
    sets = [state.held[int(h)] for h in msg["handles"]]
    reps, warmup = int(msg["reps"]), int(msg["warmup"])
    cuda = state.device.startswith("cuda")
    b: dict[str, Any] = {"sets": sets, "reps": reps, "outs": [None] * len(sets), "graph": None,
                         "note": ""}
    state.burst = None
    try:
        with torch.no_grad():
            for _ in range(warmup):
                for k, args in enumerate(sets):
                    b["outs"][k] = _as_tuple(state.run(*args, config=call_config(state, args)))
            if cuda and msg.get("graph", True):
                _capture(state, b)
    except Exception as e:  # noqa: BLE001 - the candidate's exception is a verdict
        return {"raised": _text(f"{_type(e).__name__}: {e}")}
    state.burst = b
    return {"graph": b["graph"] is not None, "note": b["note"], "calls": reps * len(sets)}


def _capture(state: _State, b: dict) -> None:
    sets, run = b["sets"], state.run
    _synchronize()
    side = _Stream()
    side.wait_stream(_current_stream())
    with _use_stream(side):  # warm up on a capture-like stream (allocator, lazy init)
        for args in sets:
            run(*args, config=call_config(state, args))
    _current_stream().wait_stream(side)
    _synchronize()
    graph = _CUDAGraph()
    outs: list = [None] * len(sets)
    try:
        with _graph(graph):
            for r in range(b["reps"]):
                for k, args in enumerate(sets):
                    o = _as_tuple(run(*args, config=call_config(state, args)))
                    if r == b["reps"] - 1:
                        outs[k] = o
    except Exception as e:  # noqa: BLE001 - timed eagerly instead, and said so
        _synchronize()
        release_generators()
        b["note"] = _text(f"cuda graph capture failed ({_type(e).__name__}: {e}); eager burst")
        return
    b["graph"], b["outs"] = graph, outs


def release_generators() -> None:
    """Take the CUDA default generators out of capture mode after a capture that failed.

    torch puts them in capture mode when a capture begins and takes them out in capture_end only
    after cudaStreamEndCapture succeeds; after a capture that failed (an unjoined side stream, a
    host sync), every later random op outside a graph raises "Offset increment outside graph
    capture encountered unexpectedly". A generator that still draws is left as it is; a stuck one
    gets a fresh state with its seed and offset. Only the current device's (the one captured on):
    probing the others would start a context on every GPU."""
    if not torch.cuda.is_initialized():
        return
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    try:
        torch.empty(1, device=gen.device).uniform_(generator=gen)
        return
    except RuntimeError as e:
        if "graph capture" not in str(e):
            raise
    fresh = torch.Generator(device=gen.device)
    fresh.manual_seed(gen.initial_seed())
    fresh.set_offset(gen.get_offset())
    gen.graphsafe_set_state(fresh)


def poison(state: _State, msg: dict, fds: list) -> dict:
    """Overwrite the graph's outputs with palette values: the next replay must rewrite them."""
    b = state.burst
    if b is None or b["graph"] is None:
        return {"poisoned": 0}
    n = 0
    for inputs, outs in zip(b["sets"], b["outs"], strict=True):
        # An output that is one of its inputs updated in place (a contract's INPLACE output, the
        # KV cache) keeps what the op does not write: poisoning it would poison the input.
        held = {t.untyped_storage().data_ptr() for t in inputs if _type(t) is torch.Tensor}
        for o in outs:
            if _type(o) is not torch.Tensor or o.untyped_storage().data_ptr() in held:
                continue
            src = palette_tile(state, _dtype_name(o), o.numel())
            if src is not None:
                o.copy_(src.to(o.device).view(o.shape))  # any strides
                n += 1
    _synchronize()
    return {"poisoned": n}


def _dtype_name(t: Any) -> str:
    from .wire import DTYPE_NAMES

    return DTYPE_NAMES.get(getattr(t, "dtype", None), "")


def run(state: _State, msg: dict, fds: list) -> dict:
    """`replays` passes of the burst; per-pass times as the worker measured them."""
    b = state.burst
    if b is None:
        return {"error": "no burst set up"}
    n = max(1, int(msg["replays"]))
    t0 = _perf()
    try:
        with torch.no_grad():
            samples = _run_cuda(state, b, n) if state.device.startswith("cuda") else \
                _run_cpu(state, b, n)
    except Exception as e:  # noqa: BLE001 - the candidate's exception is a verdict
        return {"raised": _text(f"{_type(e).__name__}: {e}")}
    return {"samples_s": samples, "total_s": _perf() - t0,
            "calls_per_sample": b["reps"] * len(b["sets"]) if b["graph"] is not None
            else len(b["sets"])}


def _run_cuda(state: _State, b: dict, n: int) -> list[float]:
    pairs = []
    for _ in range(n):
        start, end = _Event(enable_timing=True), _Event(enable_timing=True)
        start.record()
        if b["graph"] is not None:
            b["graph"].replay()
        else:
            for k, args in enumerate(b["sets"]):
                b["outs"][k] = _as_tuple(state.run(*args, config=call_config(state, args)))
        end.record()
        pairs.append((start, end))
    _synchronize()
    return [s.elapsed_time(e) * 1e-3 for s, e in pairs]


def _run_cpu(state: _State, b: dict, n: int) -> list[float]:
    samples = []
    for _ in range(n):
        t0 = _perf()
        for k, args in enumerate(b["sets"]):
            b["outs"][k] = _as_tuple(state.run(*args, config=call_config(state, args)))
        samples.append(_perf() - t0)
    return samples


def export(state: _State, msg: dict, fds: list) -> dict:
    b = state.burst
    if b is None:
        return {"error": "no burst set up"}
    if state.device.startswith("cuda"):
        _synchronize()
    off, end = _region(msg)
    data = []
    for k, expect in zip(msg["indices"], msg["expect"], strict=True):
        descs, off = _write_outputs(state, b["outs"][int(k)] or (), expect, off, end)
        data.append(descs)
    return {"data": data}


def marathon(state: _State, msg: dict, fds: list) -> dict:
    """Eager calls on the held sets in turn, `calls` of them or until `time_s` has passed, the
    outputs dropped: state that counts calls is past any count the judge's earlier calls
    reached before the calls judged after this. Reports how many were made."""
    sets = [state.held[int(h)] for h in msg["handles"]]
    n, limit = max(1, int(msg["calls"])), float(msg["time_s"])
    cuda = state.device.startswith("cuda")
    done, t0 = 0, _perf()
    try:
        with torch.no_grad():
            while done < n:
                _as_tuple(state.run(*sets[done % len(sets)],
                                    config=call_config(state, sets[done % len(sets)])))
                done += 1
                if cuda and done % 64 == 0:
                    _synchronize()  # the clock then counts finished calls, not queued ones
                if _perf() - t0 > limit:
                    break
            if cuda:
                _synchronize()
    except Exception as e:  # noqa: BLE001 - the candidate's exception is a verdict
        return {"raised": _text(f"{_type(e).__name__}: {e}"), "calls": done}
    return {"calls": done, "elapsed_s": _perf() - t0}
