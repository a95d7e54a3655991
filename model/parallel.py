"""Tensor parallelism over torch.distributed process groups (NCCL on GPUs, gloo on CPU).

    group = init_tp(tp, rank, backend, init_method)     # one process per rank
    attach(load_model(path, tp=tp, rank=rank), group)   # sets the model's TP hooks
    results = launch(fn, tp, backend)                   # or start the ranks here (spawn / torchrun)

The model computes row-parallel partials (o_proj, dense down, each rank's combined experts) and
hands them to `TPGroup.boundary`, which sums the ranks and applies the sandwich-norm boundary
(`model/ops/allreduce_norm_residual_norm.py`). Every sum of rank partials here is deterministic
and identical on every rank: all-gather, FP32 sum in rank order, one rounding. That matters
beyond reproducibility: the MoE router runs on every rank and must pick the same experts.
The vocab-parallel lm_head output is gathered in BF16 before the FP32 softcap.

Boundary implementations are a name registry (`BOUNDARIES`): "gather" (the reference above, which
calls the op through the model's OpTable, so a fused kernel for the stacked form plugs in),
"allreduce" (the backend's in-place all-reduce, then the unfused `norm_residual_norm`; equal to
"gather" bitwise at TP=2, not beyond) and "oneshot" (model/p2p.py: every rank reads its peers'
partials over NVLink from buffers exchanged once, and one kernel sums them in FP32 rank order and
applies the norms; bitwise equal to "gather", whose path it takes where it cannot run: on CPU,
without peer access, for a non-bf16 model or a call larger than its buffers). NCCL groups use
"oneshot" by default, set up by `attach` (a start-up check against "gather" on every rank decides;
`TPGroup.boundary_note` says which runs and why). Others register with `register_boundary`.
NVLink multicast stays off: `init_tp` refuses an environment that enables it (p2p.py).
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import connection as mp_connection
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import p2p
from .ops.allreduce_norm_residual_norm import rank_sum
from .ops.precision import use_contract_precision

BACKENDS = ("gloo", "nccl")
DEFAULT_PG_TIMEOUT_S = 300.0
# After a rank has failed, how long the others get to exit on SIGTERM before SIGKILL.
_STOP_GRACE_S = 5.0
# After every rank has returned its result, how long each gets to exit by itself.
_EXIT_GRACE_S = 30.0
# When a rank reports an error, how long to wait for a peer's death that may have caused it.
_PEER_GRACE_S = 2.0

Tensor = torch.Tensor
BoundaryFn = Callable[..., tuple[Tensor, Tensor]]


class TPError(RuntimeError):
    """A tensor-parallel group could not start or lost a rank; the message names the rank."""


# ---- the group ------------------------------------------------------------------------------
@dataclass
class TPGroup:
    """One rank's view of its tensor-parallel group. At size 1 every collective is the identity."""

    rank: int
    size: int
    backend: str
    device: torch.device
    pg: Any = None  # torch.distributed ProcessGroup; None at size 1
    boundary_impl: str = "gather"
    peers: p2p.PeerView | None = None  # the one-shot buffers, once `attach` set them up
    boundary_note: str = ""  # which boundary runs, and why (set by `attach`)

    def gather_partials(self, t: Tensor) -> Tensor:
        """[R, *t.shape]: every rank's `t`, in rank order (bitwise copies, any dtype)."""
        if self.size == 1:
            return t.unsqueeze(0)
        t = t.contiguous()
        out = torch.empty((self.size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        _all_gather_single(out, t, group=self.pg)
        return out.view(self.size, *t.shape)

    def all_reduce(self, t: Tensor) -> Tensor:
        """Sum over ranks: FP32 in rank order, rounded once to t's dtype; same bits everywhere."""
        if self.size == 1:
            return t
        if self.peers is not None and self.peers.fits(t):
            return self.peers.all_reduce(t)
        return rank_sum(self.gather_partials(t))

    def all_gather_vocab(self, t: Tensor) -> Tensor:
        """[..., V/R] vocab slice per rank -> [..., V], rank r's slice at columns r*V/R..."""
        if self.size == 1:
            return t
        return torch.cat(self.gather_partials(t).unbind(0), dim=-1)

    def boundary(self, ops, partial: Tensor, residual: Tensor, post_weight: Tensor,
                 next_weight: Tensor, add_index: int, eps: float) -> tuple[Tensor, Tensor]:
        """Rank sum of `partial` + post-norm + depth-scaled residual + next pre-norm.

        May reuse `partial`'s memory (the "allreduce" implementation reduces in place).
        """
        try:
            impl = BOUNDARIES[self.boundary_impl]
        except KeyError:
            raise ValueError(f"unknown TP boundary {self.boundary_impl!r}; registered: "
                             f"{sorted(BOUNDARIES)}") from None
        return impl(self, ops, partial, residual, post_weight, next_weight, add_index, eps)

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.pg)

    def broadcast(self, t: Tensor, src: int = 0) -> Tensor:
        """In place: every rank's `t` becomes rank `src`'s."""
        if self.size > 1:
            dist.broadcast(t, src=src, group=self.pg)
        return t

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank `src`'s picklable `obj` on every rank (a scheduler's step plan, a request)."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.pg,
                                   device=self.device if self.backend == "nccl" else None)
        return box[0]

    def destroy(self) -> None:
        if self.peers is not None:
            self.peers.close()
            self.peers = None
        if self.pg is not None and dist.is_initialized():
            dist.destroy_process_group(self.pg)
        self.pg = None


def _all_gather_single(out: Tensor, t: Tensor, group) -> None:
    # torch 2.13 renamed all_gather_into_tensor (deprecated there); the H200 image has 2.11.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, t, group=group)


# ---- boundary implementations ---------------------------------------------------------------
def _gather_boundary(group: TPGroup, ops, partial, residual, post_weight, next_weight,
                     add_index: int, eps: float):
    partials = group.gather_partials(partial)  # [R, T, H]
    return ops.allreduce_norm_residual_norm(partials, residual, post_weight, next_weight,
                                            add_index, eps)


def _allreduce_boundary(group: TPGroup, ops, partial, residual, post_weight, next_weight,
                        add_index: int, eps: float):
    # The backend's reduction order and rounding (NCCL: per-step BF16 adds, order by algorithm).
    dist.all_reduce(partial, group=group.pg)
    return ops.norm_residual_norm(partial, residual, post_weight, next_weight, add_index, eps)


def _oneshot_boundary(group: TPGroup, ops, partial, residual, post_weight, next_weight,
                      add_index: int, eps: float):
    # Every rank sees the same shapes, so every rank takes the same path on every call.
    peers = group.peers
    if peers is None or not peers.fits(partial):
        return _gather_boundary(group, ops, partial, residual, post_weight, next_weight,
                                add_index, eps)
    return peers.boundary(partial, residual, post_weight, next_weight, add_index, eps)


BOUNDARIES: dict[str, BoundaryFn] = {"gather": _gather_boundary, "allreduce": _allreduce_boundary,
                                     "oneshot": _oneshot_boundary}


def register_boundary(name: str, fn: BoundaryFn) -> None:
    """Add a boundary implementation: fn(group, ops, partial, residual, post_weight,
    next_weight, add_index, eps) -> (normed_next, new_residual)."""
    if name in BOUNDARIES and BOUNDARIES[name] is not fn:
        raise ValueError(f"TP boundary {name!r} is already registered")
    BOUNDARIES[name] = fn


# ---- setup ----------------------------------------------------------------------------------
def init_tp(tp: int, rank: int, backend: str = "gloo", init_method: str = "env://",
            timeout_s: float = DEFAULT_PG_TIMEOUT_S, local_rank: int | None = None,
            boundary_impl: str | None = None) -> TPGroup:
    """Join (or create) the process group of `tp` ranks as `rank`; tp=1 needs no process group.

    NCCL ranks use GPU `local_rank` (default: $LOCAL_RANK, else `rank`). A collective that waits
    longer than `timeout_s` for a peer raises instead of hanging. `boundary_impl` (a BOUNDARIES
    name) defaults to "oneshot" for NCCL and "gather" for gloo.
    """
    if boundary_impl is None:
        boundary_impl = "oneshot" if backend == "nccl" else "gather"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if tp < 1 or not 0 <= rank < tp:
        raise ValueError(f"need tp >= 1 and 0 <= rank < tp, got tp={tp}, rank={rank}")
    if boundary_impl not in BOUNDARIES:
        raise ValueError(f"unknown TP boundary {boundary_impl!r}; registered: {sorted(BOUNDARIES)}")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cpu")
    if backend == "nccl":
        # NVLink multicast (NVLS) is switched off on our GPU machines and must not be used.
        try:
            p2p.disable_multicast()
        except p2p.P2PError as exc:
            raise TPError(f"rank {rank}: {exc}") from None
        if not torch.cuda.is_available() or local_rank >= torch.cuda.device_count():
            raise TPError(f"rank {rank}: backend 'nccl' needs GPU {local_rank}, but "
                          f"{torch.cuda.device_count()} GPU(s) are visible; use backend='gloo' "
                          "on CPU or fewer ranks")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if tp == 1:
        return TPGroup(0, 1, backend, device, None, boundary_impl)
    if dist.is_initialized():
        if dist.get_world_size() != tp or dist.get_rank() != rank:
            raise TPError(f"a process group of {dist.get_world_size()} ranks (this is rank "
                          f"{dist.get_rank()}) already exists; cannot join as rank {rank} of {tp}")
    else:
        extra = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=tp,
                                timeout=timedelta(seconds=timeout_s), **extra)
    return TPGroup(rank, tp, backend, device, dist.group.WORLD, boundary_impl)


def attach(model, group: TPGroup, max_tokens: int = p2p.DEFAULT_CAPACITY):
    """Point `model`'s TP hooks at `group`: embedding sum, vocab gather, the fused boundary.

    With the "oneshot" boundary this is collective (every rank attaches its model): the first
    bf16 model sets up the peer buffers for `max_tokens` tokens a call and checks them.
    """
    shard = model.shard
    if shard.tp != group.size or model.rank != group.rank:
        raise ValueError(f"model holds rank {model.rank} of a TP{shard.tp} shard, but the group "
                         f"is rank {group.rank} of {group.size}: load the model with "
                         f"tp={group.size}, rank={group.rank}")
    if model.device.type != group.device.type:
        raise ValueError(f"model is on {model.device}, the {group.backend} group on "
                         f"{group.device}: move the model with model.to(group.device)")
    if group.size == 1:
        model.all_reduce, model.gather_vocab, model.tp_boundary = _identity, _identity, None
        return model
    if group.boundary_impl == "oneshot":
        _setup_oneshot(model, group, max_tokens)
    else:
        group.boundary_note = f"{group.boundary_impl} boundary"
    model.all_reduce = group.all_reduce
    model.gather_vocab = group.all_gather_vocab
    model.tp_boundary = group.boundary
    return model


def _setup_oneshot(model, group: TPGroup, max_tokens: int) -> None:
    h = model.config.hidden_size
    if group.peers is not None and group.peers.hidden == h and model.dtype == torch.bfloat16:
        return  # set up by an earlier model of the same width
    if group.peers is not None:
        group.peers.close()
        group.peers = None
    ops = model.ops

    def reference(partial, residual, post_weight, next_weight, add_index, eps):
        return _gather_boundary(group, ops, partial, residual, post_weight, next_weight,
                                add_index, eps)

    group.peers, group.boundary_note = p2p.setup_oneshot(group, h, model.dtype, max_tokens,
                                                         reference)


def _identity(t: Tensor) -> Tensor:
    return t


# ---- launching the ranks --------------------------------------------------------------------
def launch(fn: Callable[..., Any], tp: int, backend: str = "gloo", args: tuple = (),
           timeout_s: float | None = None, pg_timeout_s: float = DEFAULT_PG_TIMEOUT_S,
           threads: int | None = None) -> list[Any]:
    """Run `fn(group, *args)` on every rank of a TP group; return the results, index = rank.

    Started by `torchrun` (RANK/WORLD_SIZE/MASTER_ADDR set), this process is one rank; the
    results are exchanged so every rank returns the full list. Otherwise `tp` worker processes
    are spawned here (fn and args must be picklable, fn defined at module level; results are
    pickled back, so return CPU objects). If a rank raises, exits or is killed, the others are
    stopped and `TPError` says which rank and how; `timeout_s` bounds the whole run, and
    `pg_timeout_s` any one collective. `threads`: torch CPU threads per spawned rank (default
    for gloo: cores / tp, since oversubscribed CPU ranks slow down many times). tp=1 runs `fn`
    in this process.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if _under_torchrun():
        return _run_torchrun_rank(fn, tp, backend, args, pg_timeout_s)
    if tp == 1:
        group = init_tp(1, 0, backend)
        return [fn(group, *args)]
    if threads is None and backend == "gloo":
        threads = max(1, (os.cpu_count() or 1) // tp)  # CPU ranks share the cores
    ctx = mp.get_context("spawn")
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    procs, readers = [], []
    for rank in range(tp):
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_worker, name=f"tp-rank-{rank}", args=(
            fn, rank, tp, backend, init_method, pg_timeout_s, args, threads, writer, os.getpid()))
        proc.start()
        writer.close()  # the child holds the only write end, so its death reads as EOF
        procs.append(proc)
        readers.append(reader)
    try:
        return _collect(procs, readers, backend, timeout_s)
    finally:
        _stop(procs)


def _under_torchrun() -> bool:
    env = os.environ
    return "TORCHELASTIC_RUN_ID" in env or all(k in env for k in ("RANK", "WORLD_SIZE",
                                                                  "MASTER_ADDR"))


def _run_torchrun_rank(fn, tp: int, backend: str, args: tuple, pg_timeout_s: float) -> list:
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if world != tp:
        raise TPError(f"torchrun started {world} processes but tp={tp}: run torchrun with "
                      f"--nproc-per-node {tp} (one process per TP rank)")
    group = init_tp(tp, rank, backend, "env://", pg_timeout_s)
    # If this rank raises, the process exits non-zero and torchrun's agent stops the others.
    result = fn(group, *args)
    results: list[Any] = [None] * tp
    if tp > 1:
        dist.all_gather_object(results, result, group=group.pg)
    else:
        results[0] = result
    group.destroy()
    return results


def _worker(fn, rank: int, tp: int, backend: str, init_method: str, pg_timeout_s: float,
            args: tuple, threads: int | None, conn, parent_pid: int) -> None:
    _exit_with_parent(parent_pid)
    if threads:
        torch.set_num_threads(threads)
    use_contract_precision()  # each rank's GEMMs round as the op contracts say
    try:
        group = init_tp(tp, rank, backend, init_method, pg_timeout_s, local_rank=rank)
        payload = pickle.dumps(("ok", fn(group, *args)))
    except BaseException as exc:  # report anything, SystemExit included, to the parent
        text = "".join(traceback.format_exception(exc))
        sys.stderr.write(f"[tp rank {rank}] {text}")
        sys.stderr.flush()
        conn.send_bytes(pickle.dumps(("error", f"{type(exc).__name__}: {exc}\n{text}")))
        raise SystemExit(1) from None
    conn.send_bytes(payload)
    conn.close()
    group.destroy()
    # Nothing is left to do; skipping the interpreter's teardown saves seconds per rank.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _exit_with_parent(parent_pid: int) -> None:
    # A rank whose launcher died (killed, crashed) must not linger holding a GPU.
    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os._exit(70)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def _collect(procs, readers, backend: str, timeout_s: float | None) -> list[Any]:
    n = len(procs)
    results: dict[int, Any] = {}
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while len(results) < n:
        pending = [r for r in range(n) if r not in results]
        wait_s = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
        if wait_s <= 0:
            raise TPError(f"tensor-parallel group ({backend}, {n} ranks) did not finish within "
                          f"{timeout_s:.0f} s; ranks {pending} were still running and were "
                          "stopped")
        ready = mp_connection.wait([readers[r] for r in pending]
                                   + [procs[r].sentinel for r in pending], timeout=wait_s)
        for r in pending:
            if readers[r] not in ready and procs[r].sentinel not in ready:
                continue
            got = _receive(readers[r], procs[r])
            if got is None:
                raise TPError(_death_message(r, procs, backend))
            status, value = got
            if status == "error":
                raise TPError(_error_message(r, value, procs, readers, pending, backend))
            results[r] = value
    for proc in procs:
        proc.join(_EXIT_GRACE_S)
    return [results[r] for r in range(n)]


def _receive(reader, proc) -> tuple[str, Any] | None:
    """The rank's (status, value), or None if it ended without sending one."""
    try:
        if not reader.poll():
            proc.join(1.0)  # the sentinel fired: a result sent just before exit is in the pipe
            if not reader.poll():
                return None
        return pickle.loads(reader.recv_bytes())
    except (EOFError, OSError):
        return None


def _error_message(rank: int, text: str, procs, readers, pending, backend: str) -> str:
    # A peer that dies makes the survivors' next collective fail ("connection closed"); name the
    # dead rank as the cause when there is one, not the survivor that noticed first.
    others = [q for q in pending if q != rank]
    if others:
        mp_connection.wait([procs[q].sentinel for q in others], timeout=_PEER_GRACE_S)
    for q in others:
        if not procs[q].is_alive() and _receive(readers[q], procs[q]) is None:
            first = text.splitlines()[0] if text else "?"
            return f"{_death_message(q, procs, backend)}\nRank {rank} then failed: {first}"
    return (f"tensor-parallel group ({backend}, {len(procs)} ranks) stopped: rank {rank} raised "
            f"{text}\nThe other ranks were terminated.")


def _death_message(rank: int, procs, backend: str) -> str:
    proc = procs[rank]
    proc.join(_STOP_GRACE_S)
    code = proc.exitcode
    if code is None:
        how = "closed its result pipe but is still running"
    elif code < 0:
        name = signal.Signals(-code).name
        hint = " (the out-of-memory killer, or kill -9)" if name == "SIGKILL" else ""
        how = f"was killed by {name}{hint}"
    elif code == 0:
        how = "exited with code 0 without returning a result"
    else:
        how = f"exited with code {code} before returning a result"
    others = [r for r in range(len(procs)) if r != rank]
    return (f"tensor-parallel group ({backend}, {len(procs)} ranks) stopped: rank {rank} {how}; "
            f"terminated the other ranks {others}. Its own output above says why.")


def _stop(procs) -> None:
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.terminate()
    end = time.monotonic() + _STOP_GRACE_S
    for p in alive:
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


def _free_port() -> int:
    # Another process may take the port before rank 0 binds it; rare, and init then fails loudly.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
