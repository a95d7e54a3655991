"""The worker: a minimal runner that holds a candidate and the inputs it is handed, nothing else.

Started by the judge (`channel.Worker`) as `python -m autoopt.eval.worker SOCKET`; it connects
back, then does what each request says: keep input tensors the judge wrote into the arena, call
the candidate on them (after filling free memory with the judge's poison, which looks like
data), copy outputs back into the arena, capture and replay CUDA graphs of many calls, and report
what it saw (output structure, aliasing, times, a digest of the candidate's state). It never sees
the op, the reference, the seeds or a judgement; it imports no judge code (only `wire`, `audit`
and its own `worker_burst` and `worker_state`). The judge believes nothing it says without a
check of its own: outputs are judged against the judge's references, and times against the
judge's wall clock.

Before the candidate is imported the runner imports what the candidate will import, binds its
timers, installs the audit hook (audit.py) and drops the repository from `sys.path`; on CPU it
also wraps the Triton interpreter's grid so that programs can run in a permuted order (a kernel
whose result depends on program order has a cross-program race).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import random
import select
import socket
import sys
import threading
import time
import traceback
from typing import Any

import torch

from . import audit, wire

_perf = time.perf_counter
_is_tensor = torch.Tensor
_type = type
_MAX_TEXT = 600


class _State:
    def __init__(self, device: str) -> None:
        self.device = device
        self.arena: wire.Arena | None = None
        self.run: Any = None
        self.module: Any = None  # the candidate's module (None: a trusted in-process callable)
        self.config: dict | None = None
        # A config per token bucket, chosen call by call (the registry's nearest-bucket rule on
        # the call's token count, read at `token_at` = (argument, axis)); None: `config` always.
        self.configs: list[tuple[int, dict | None]] | None = None
        self.token_at: tuple[int, int] | None = None
        # With `served`, the table applies only where the fixed dims at `dims_at` have one of
        # those sizes; elsewhere `config` (the default), as serving's lookup.
        self.dims_at: list[tuple[int, int]] = []
        self.served: set[tuple[int, ...]] = set()
        self.held: dict[int, list] = {}
        self.outs: dict[int, tuple] = {}
        self.palette: dict[str, torch.Tensor] = {}
        self.gen = torch.Generator(device="cpu")
        self.order = {"mode": "natural", "rng": random.Random(0), "permuted": 0}
        self.blocked = lambda: []
        self.burst: dict[str, Any] | None = None


def main(argv: list[str] | None = None) -> int:
    path = (argv or sys.argv[1:])[0]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    leaving = threading.Event()
    threading.Thread(target=_exit_with_judge, args=(sock.fileno(), leaving), daemon=True).start()
    state = _State("cpu")
    handlers = _handlers()
    while True:
        try:
            msg, fds = wire.recv(sock, want_fds=1)
        except (EOFError, ConnectionError):
            break
        cmd = msg.get("cmd")
        try:
            reply = handlers[cmd](state, msg, fds) if cmd in handlers else {
                "error": f"unknown command {cmd!r}"}
        except BaseException as e:  # noqa: BLE001 - reported to the judge, never fatal
            reply = {"error": _text(f"{_type(e).__name__}: {e}"),
                     "trace": _text(traceback.format_exc()[-1500:])}
        reply["blocked"] = state.blocked()
        if cmd == "exit":
            leaving.set()  # the judge closes its end after this reply: exit the normal way
        wire.send(sock, reply)
        if cmd == "exit":
            if msg.get("clean"):  # under compute-sanitizer: let CUDA tear down, reports flush
                if state.device.startswith("cuda"):
                    torch.cuda.synchronize()
                sys.stdout.flush()
                sys.exit(0)
            break
    sys.stdout.flush()
    os._exit(0)  # a candidate's atexit hooks and finalizers never run


def _exit_with_judge(fd: int, leaving: threading.Event) -> None:
    """End this process as soon as the judge's end of the socket closes (the judge exited or
    was killed), even in the middle of a candidate's call: the worker runs in a session of its
    own, so nothing else would stop it from holding the GPU's memory after its judge is gone."""
    poller = select.poll()
    poller.register(fd, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    while not leaving.is_set():
        if poller.poll(1000) and not leaving.is_set():
            os._exit(3)


def _text(s: str) -> str:
    return s if len(s) <= _MAX_TEXT else s[:_MAX_TEXT - 3] + "..."


def _handlers() -> dict[str, Any]:
    from . import worker_burst as wb  # binds its timers now, before any candidate is loaded
    from . import worker_state as ws

    return {"hello": _hello, "arena": _arena, "load": _load, "palette": _set_palette,
            "put": _put, "write": _write, "call": _call, "export": _export,
            "readback": _readback, "drop": _drop, "burst_setup": wb.setup,
            "burst_poison": wb.poison, "burst_run": wb.run, "burst_export": wb.export,
            "marathon": wb.marathon,
            "state": lambda s, m, f: {"digest": _state_digest(s, ws)},
            "ping": lambda s, m, f: {}, "exit": lambda s, m, f: {}}


def _hello(state: _State, msg: dict, fds: list) -> dict:
    # The GEMM precision flags the judge names (the contracts', model/ops/precision.py: the
    # worker imports no model code), set before any candidate loads: it runs as it serves.
    m, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    for key, value in (msg.get("precision") or {}).items():
        if key == "cudnn.allow_tf32":
            cudnn.allow_tf32 = bool(value)
        elif key.startswith("allow_") and hasattr(m, key):
            setattr(m, key, bool(value))
    flags = {k: bool(getattr(m, k)) for k in msg.get("precision") or {} if hasattr(m, k)}
    return {"pid": os.getpid(), "torch": torch.__version__,
            "precision": {**flags, "cudnn.allow_tf32": bool(cudnn.allow_tf32)}}


def _arena(state: _State, msg: dict, fds: list) -> dict:
    if len(fds) != 1:
        return {"error": "arena without a file descriptor"}
    if state.arena is not None:
        state.arena.close()
    state.arena = wire.Arena(int(msg["size"]), fd=fds[0])
    return {}


def _load(state: _State, msg: dict, fds: list) -> dict:
    """Preload the candidate's imports, arm the sandbox, then import the candidate."""
    state.device = msg["device"]
    state.config = msg.get("config")
    if msg.get("configs") and msg.get("token_at"):
        state.configs = [(int(b), dict(c) if c is not None else None) for b, c in msg["configs"]]
        state.token_at = (int(msg["token_at"][0]), int(msg["token_at"][1]))
        state.dims_at = [(int(i), int(a)) for i, a in msg.get("dims_at") or []]
        state.served = {tuple(int(x) for x in d) for d in msg.get("served") or []}
    for name in msg.get("preload", []):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the candidate's own import will report it
            pass
    if os.environ.get("TRITON_INTERPRET") == "1" and not state.device.startswith("cuda"):
        _permutable_grid(state.order)
    root = os.path.realpath(msg["repo_root"])
    if os.path.isfile(os.path.join(root, "pyproject.toml")):  # a checkout, not site-packages
        sys.path[:] = [p for p in sys.path if p and os.path.realpath(p) != root
                       and os.path.realpath(p) != os.getcwd()]
    # Global RNGs start from a secret seed: a fresh process's first random numbers tell nothing.
    torch.manual_seed(int(msg.get("rng_seed", 0)))
    state.blocked = audit.install(msg["path"], audit.default_read_roots(), msg["imports"])
    spec = importlib.util.spec_from_file_location(msg["module"], msg["path"])
    if spec is None or spec.loader is None:
        return {"error": f"cannot load {msg['path']} as a module"}
    module = importlib.util.module_from_spec(spec)
    sys.modules[msg["module"]] = module  # Triton's source lookup wants the module registered
    try:
        spec.loader.exec_module(module)
    except BaseException as e:  # noqa: BLE001 - the candidate's import error is a verdict
        return {"import_error": _text(f"{_type(e).__name__}: {e}")}
    run = module.__dict__.get("run")
    if not callable(run):
        return {"import_error": "defines no callable `run`"}
    state.run, state.module = run, module
    if state.config is None and module.__dict__.get("DEFAULT_CONFIG") is not None:
        # Serving calls a variant without a tuned config for the call with its DEFAULT_CONFIG
        # (the registry's KernelCall): so does the judge, or `config is None` would tell the
        # two apart.
        try:
            state.config = dict(module.__dict__["DEFAULT_CONFIG"])
        except Exception as e:  # noqa: BLE001 - a malformed default is a verdict
            return {"import_error": _text(f"DEFAULT_CONFIG is not a mapping "
                                          f"({_type(e).__name__}: {e})")}
    return {"config": _text(repr(state.config))}


def call_config(state: _State, args: Any = ()) -> dict | None:
    """The config for one call: a fresh copy each time, as serving passes (a variant that
    edits its config cannot carry state to the next call through it). With a config per bucket,
    the one serving would pick for the call's token count; a bucket without one (or a call
    without a token count) gets the variant's default, as serving's does."""
    cfg = state.config
    if state.configs and (not state.served or _sizes(args, state.dims_at) in state.served):
        tokens = _sizes(args, [state.token_at])
        if tokens is not None:
            cfg = nearest_bucket(state.configs, tokens[0]) or state.config
    return dict(cfg) if cfg is not None else None


def _sizes(args: Any, where: list[tuple[int, int]]) -> tuple[int, ...] | None:
    """The sizes of `args[i].shape[axis]` for each (i, axis); None where one is not a tensor's."""
    out = []
    for i, axis in where:
        a = args[i] if i < len(args) else None
        if not (_type(a) is _is_tensor and a.dim() > axis):
            return None
        out.append(int(a.shape[axis]))
    return tuple(out)


def nearest_bucket(table: list[tuple[int, dict | None]], tokens: int) -> dict | None:
    """The config of the bucket nearest `tokens` in log2, the smaller on a tie: the rule of
    model/registry/configs.py `ConfigTable.lookup` (the worker imports no registry code)."""
    t = math.log2(max(tokens, 1))
    return min(table, key=lambda e: (abs(math.log2(max(e[0], 1)) - t), e[0]))[1]


def _permutable_grid(order: dict) -> None:
    """Let the interpreter run a launch's programs in `order["mode"]` (natural, reverse, random)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    b = interpreter.interpreter_builder
    set_dim, set_idx = b.set_grid_dim, b.set_grid_idx
    grid = {"dims": (1, 1, 1), "perm": None}

    def grid_dim(nx: int, ny: int, nz: int) -> None:
        n = nx * ny * nz
        perm = None
        if order["mode"] == "reverse" and n > 1:
            perm = list(range(n - 1, -1, -1))
        elif order["mode"] == "random" and n > 1:
            perm = list(range(n))
            order["rng"].shuffle(perm)
        order["permuted"] += perm is not None
        grid["dims"], grid["perm"] = (nx, ny, nz), perm
        set_dim(nx, ny, nz)

    def grid_idx(x: int, y: int, z: int) -> None:
        perm = grid["perm"]
        if perm is not None:
            _, ny, nz = grid["dims"]
            x, rest = divmod(perm[(x * ny + y) * nz + z], ny * nz)
            y, z = divmod(rest, nz)
        set_idx(x, y, z)

    b.set_grid_dim, b.set_grid_idx = grid_dim, grid_idx


def _set_palette(state: _State, msg: dict, fds: list) -> dict:
    for name, d in msg["palettes"].items():
        state.palette[name] = state.arena.read(wire.TensorDesc.parse(d, state.arena.size))
    state.gen.manual_seed(int(msg["seed"]))
    return {}


def _materialize(state: _State, d: dict) -> Any:
    if "scalar" in d:
        return d["scalar"]
    t = state.arena.view(wire.TensorDesc.parse(d, state.arena.size))
    pad = int(d.get("pad", 0))
    offset = max(0, int(d.get("offset", 0)))
    tail = max(0, int(d.get("tail", 0)))
    if tail and t.dim() >= 1 and t.shape[0] > 0:  # the first rows of a larger allocation
        base = torch.empty((t.shape[0] + tail, *t.shape[1:]), dtype=t.dtype, device=state.device)
        out = base[:t.shape[0]]
        # The rows past the view hold the view's own values again: data, not poison.
        base[t.shape[0]:].copy_(t.repeat_interleave(-(-tail // t.shape[0]), 0)[:tail])
    elif pad > 0 and t.dim() >= 2:  # rows farther apart than their length, as serving's views
        inner = t[0].numel()
        offset = min(offset, pad)  # a slice of a wider row, never past it
        base = torch.empty(offset + t.shape[0] * (inner + pad), dtype=t.dtype,
                           device=state.device)
        # Between the rows, data (serving's gaps are other columns of the same projection), not
        # whatever the allocator left: a library kernel may read the gap and multiply it by
        # zero (torch's CPU BF16 GEMM does), and 0 * NaN is NaN.
        if t.is_floating_point():
            base.copy_(torch.randn(base.shape, generator=state.gen).to(t.dtype))
        else:
            base.zero_()
        out = base.as_strided(t.shape, (inner + pad, *t[0].contiguous().stride()), offset)
    else:
        out = torch.empty(t.shape, dtype=t.dtype, device=state.device)
    out.copy_(t)
    return out


def _put(state: _State, msg: dict, fds: list) -> dict:
    state.held[int(msg["handle"])] = [_materialize(state, d) for d in msg["args"]]
    return {}


def _write(state: _State, msg: dict, fds: list) -> dict:
    dst = state.held[int(msg["handle"])][int(msg["index"])]
    dst.copy_(state.arena.view(wire.TensorDesc.parse(msg["data"], state.arena.size)))
    return {}


def palette_tile(state: _State, dtype: str, n: int) -> torch.Tensor | None:
    """n palette values from a random offset, cyclically (what unwritten memory will hold)."""
    pal = state.palette.get(dtype)
    if pal is None or n == 0:
        return None
    start = int(torch.randint(0, pal.numel(), (1,), generator=state.gen))
    return pal[(torch.arange(n) + start) % pal.numel()]


def _poison(state: _State, expect: list[dict], copies: int = 3) -> None:
    """Fill free memory of every expected output size with palette values (data-like)."""
    if state.device.startswith("cuda"):
        torch.cuda.synchronize()
    blocks = []
    for e in expect:
        n = 1
        for d in e["shape"]:
            n *= d
        for _ in range(copies):
            src = palette_tile(state, e["dtype"], n)
            if src is not None:
                blocks.append(src.to(state.device))
    del blocks
    if state.device.startswith("cuda"):
        torch.cuda.synchronize()


def _storage(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.data_ptr() + s.nbytes()


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, a1 = _storage(a)
    b0, b1 = _storage(b)
    return a0 < b1 and b0 < a1 and a1 > a0


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.device == b.device)


def _describe(outs: tuple, args: list, state: _State, call_id: int) -> list[dict]:
    info = []
    for o in outs:
        plain = _type(o) is _is_tensor
        d: dict[str, Any] = {"plain": plain, "type": _type(o).__name__}
        if plain:
            d.update(dtype=wire.DTYPE_NAMES.get(o.dtype, str(o.dtype)), shape=list(o.shape),
                     device=str(o.device))
            d["aliases_inputs"] = [j for j, a in enumerate(args)
                                   if _type(a) is _is_tensor and _overlaps(o, a)]
            d["is_input"] = [j for j, a in enumerate(args)  # the very input (INPLACE outputs)
                             if _type(a) is _is_tensor and _same_tensor(o, a)]
            d["shares_with_calls"] = sorted({k for k, prev in state.outs.items() if k != call_id
                                             for p in prev if _type(p) is _is_tensor
                                             and _overlaps(o, p)})
        info.append(d)
    return info


def _write_outputs(state: _State, outs: tuple, expect: list[dict], off: int,
                   end: int) -> tuple[list, int]:
    """Copy the outputs that match the expected dtype and shape into the arena at [off, end);
    returns their descriptions (None where not copied) and the next free offset."""
    descs: list = []
    for o, e in zip(outs, expect, strict=False):
        ok = (_type(o) is _is_tensor and wire.DTYPE_NAMES.get(o.dtype) == e["dtype"]
              and list(o.shape) == e["shape"])
        if not ok:
            descs.append(None)
            continue
        host = o.detach().to("cpu")
        if off + host.numel() * host.element_size() > end:
            descs.append(None)
            continue
        descs.append(state.arena.write(host, off).to_json())
        off = wire.aligned(off + host.numel() * host.element_size())
    return descs, off


def _region(msg: dict) -> tuple[int, int]:
    off = int(msg["region"]["off"])
    return off, off + int(msg["region"]["cap"])


def _as_tuple(x: Any) -> tuple:
    return tuple(x) if isinstance(x, tuple | list) else (x,)


def _call(state: _State, msg: dict, fds: list) -> dict:
    args = state.held[int(msg["handle"])]
    call_id = int(msg["out"])
    _poison(state, msg["expect"])
    state.order["mode"] = msg.get("order", "natural")
    state.order["rng"].seed(int(msg.get("order_seed", 0)))
    state.order["permuted"] = 0
    t0 = _perf()
    try:
        with torch.no_grad():
            outs = _as_tuple(state.run(*args, config=call_config(state, args)))
    except Exception as e:  # noqa: BLE001 - the candidate's exception is a verdict
        return {"raised": _text(f"{_type(e).__name__}: {e}")}
    finally:
        state.order["mode"] = "natural"
    elapsed = _perf() - t0
    state.outs[call_id] = outs
    return {"outputs": _describe(outs, args, state, call_id), "count": len(outs),
            "data": _write_outputs(state, outs, msg["expect"], *_region(msg))[0],
            "elapsed_s": elapsed, "permuted_launches": state.order["permuted"]}


def _state_digest(state: _State, ws: Any) -> dict[str, str]:
    """A digest per module-level name of what the candidate keeps between calls
    (worker_state.py); the judge compares two taken after identical calls."""
    if state.device.startswith("cuda"):
        torch.cuda.synchronize()
    return ws.digest(state.module, state.run, state.device)


def _export(state: _State, msg: dict, fds: list) -> dict:
    if state.device.startswith("cuda"):
        torch.cuda.synchronize()
    return {"data": _write_outputs(state, state.outs[int(msg["out"])], msg["expect"],
                                   *_region(msg))[0]}


def _readback(state: _State, msg: dict, fds: list) -> dict:
    off, descs = int(msg["region"]["off"]), []
    for a in state.held[int(msg["handle"])]:
        if _type(a) is not _is_tensor:
            descs.append(None)
            continue
        descs.append(state.arena.write(a.detach().to("cpu"), off).to_json())
        off = wire.aligned(off + a.numel() * a.element_size())
    return {"data": descs}


def _drop(state: _State, msg: dict, fds: list) -> dict:
    for h in msg.get("handles", []):
        state.held.pop(int(h), None)
    for k in msg.get("outs", []):
        state.outs.pop(int(k), None)
    if msg.get("burst"):
        state.burst = None
    return {}


if __name__ == "__main__":
    # Run the package's module object, not this `__main__` copy (worker_burst imports it).
    from autoopt.eval import worker as _worker

    _worker.main()
