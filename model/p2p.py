"""Peer-to-peer rank buffers for the one-shot TP boundary (no NCCL on the boundary's path).

Each rank allocates one buffer at start-up: two slots of [capacity, H] bf16 for its partials and
an int64 flag per (rank, row) that peers write; the buffers are exchanged once over the process
group as CUDA IPC handles, and each rank maps every peer's buffer into its own address space
(opened on its own GPU, reached over NVLink). A boundary call is then two kernels on the rank's
stream (kernels/allreduce_norm_residual_norm/oneshot_v1.py): `publish` copies the partial into
the rank's buffer and sets its flag in every peer's buffer; the row program waits for every
rank's flag of each row, reads the R partials in place, sums them in FP32 in rank order with one
rounding and applies the sandwich-norm boundary. Per-row epochs live on the device, so the calls
can be captured in a CUDA graph.

NVLink multicast (NVLS) is switched off on our GPU machines and must not be used: nothing here
creates a multicast object, and `disable_multicast` (called before NCCL or any peer mapping is
set up) sets NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1, refusing to run when the
environment asks for multicast.

    view = exchange(pg, rank, size, RankBuffers.allocate(size, capacity, hidden, device))
    normed, new_res = view.boundary(partial, residual, post_w, next_w, add_index, eps)
    views = simulate_ranks(size, capacity, hidden, device)   # all ranks in one process (tests)
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

Tensor = torch.Tensor
OP = "allreduce_norm_residual_norm"
VARIANT = "oneshot_v1"
DEFAULT_CAPACITY = 8192  # rows per call; a larger call takes the fallback boundary
# Environment settings that keep NVLink multicast off (NCCL's NVLS algorithms, and torch
# symmetric memory's multicast objects).
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
_ALIGN = 256


class P2PError(RuntimeError):
    """Peer-to-peer buffers could not be set up or a peer never published."""


def disable_multicast() -> None:
    """Set the MULTICAST_OFF variables where unset; refuse a setting that turns multicast on."""
    for key, off in MULTICAST_OFF.items():
        value = os.environ.get(key)
        if value is None:
            os.environ[key] = off
        elif value.strip() != off:
            raise P2PError(f"{key}={value!r} asks for NVLink multicast, which is switched off on "
                           f"these machines and must not be used: unset {key} or set {key}={off}")


def load_kernel() -> ModuleType:
    """The oneshot_v1 variant from the registry shipped with the code (its record's bytes)."""
    from .registry import Registry, RegistryError

    reg = Registry()
    variant, _ = reg.read_variant(OP, VARIANT)
    record = reg.read_record(OP, VARIANT)
    if record is not None and record.variant.sha256 != variant.sha256:
        raise RegistryError(f"{OP}/{VARIANT}.py changed since it was recorded (sha256 "
                            f"{variant.sha256[:12]}, recorded {record.variant.sha256[:12]})")
    return reg.load_variant(OP, VARIANT)


# ---- one rank's allocation -------------------------------------------------------------------
@dataclass
class RankBuffers:
    """What one rank allocates and shares: partial slots [2, capacity, H] and flags [R, capacity]
    in one allocation (one IPC handle); epochs and status stay private to the rank."""

    raw: Tensor  # uint8, the shared allocation
    size: int
    capacity: int
    hidden: int
    epochs: Tensor = field(repr=False)
    status: Tensor = field(repr=False)

    @classmethod
    def allocate(cls, size: int, capacity: int, hidden: int, device) -> RankBuffers:
        if size < 1 or capacity < 1 or hidden < 1:
            raise ValueError(f"need size, capacity and hidden >= 1; got {size}, {capacity}, "
                             f"{hidden}")
        device = torch.device(device)
        raw = torch.zeros(_layout(size, capacity, hidden)[2], dtype=torch.uint8, device=device)
        return cls(raw, size, capacity, hidden,
                   torch.zeros(capacity, dtype=torch.int64, device=device),
                   torch.zeros(1, dtype=torch.int32, device=device))

    def views(self, raw: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(data, flags) over `raw` (this rank's allocation, or a peer's mapped copy of it)."""
        raw = self.raw if raw is None else raw
        data_bytes, flag_off, total = _layout(self.size, self.capacity, self.hidden)
        if raw.numel() != total:
            raise P2PError(f"a rank buffer has {raw.numel()} bytes, expected {total}: the ranks "
                           "disagree on size, capacity or hidden size")
        data = raw[:data_bytes].view(torch.bfloat16).view(2, self.capacity, self.hidden)
        flags = raw[flag_off:].view(torch.int64).view(self.size, self.capacity)
        return data, flags


def _layout(size: int, capacity: int, hidden: int) -> tuple[int, int, int]:
    data_bytes = 2 * capacity * hidden * 2
    flag_off = -(-data_bytes // _ALIGN) * _ALIGN
    return data_bytes, flag_off, flag_off + size * capacity * 8


# ---- one rank's view of every rank's buffers ----------------------------------------------------
@dataclass
class PeerView:
    """Rank `rank`'s handles on every rank's buffer (its own, and its peers' as mapped here)."""

    rank: int
    mine: RankBuffers
    data: list[Tensor]  # index = rank
    flags: list[Tensor]  # index = rank
    kernel: ModuleType
    spin_limit: int | None = None  # None: the kernel's SPIN_LIMIT
    keep: list[Any] = field(default_factory=list, repr=False)  # mapped peer storages

    @property
    def size(self) -> int:
        return len(self.data)

    @property
    def capacity(self) -> int:
        return self.mine.capacity

    @property
    def hidden(self) -> int:
        return self.mine.hidden

    @property
    def device(self) -> torch.device:
        return self.mine.raw.device

    def fits(self, t: Tensor) -> bool:
        """Whether the one-shot path takes `t` (else the caller's fallback does)."""
        return (t.dim() == 2 and t.dtype == torch.bfloat16 and t.shape[1] == self.hidden
                and 0 < t.shape[0] <= self.capacity and t.device == self.device
                and t.stride(-1) == 1)

    def _spin(self) -> dict:
        return {} if self.spin_limit is None else {"spin_limit": self.spin_limit}

    def publish(self, partial: Tensor) -> None:
        self.kernel.publish(partial, self.data[self.rank], self.flags, self.mine.epochs,
                            self.rank)

    def boundary(self, partial: Tensor, residual: Tensor, post_weight: Tensor,
                 next_weight: Tensor, add_index: int, eps: float,
                 config: dict | None = None) -> tuple[Tensor, Tensor]:
        """Publish this rank's partial, then the fused boundary over all R ranks' partials."""
        self.publish(partial)
        return self.wait_boundary(residual, post_weight, next_weight, add_index, eps, config)

    def wait_boundary(self, residual, post_weight, next_weight, add_index: int, eps: float,
                      config: dict | None = None) -> tuple[Tensor, Tensor]:
        """The second half of `boundary` (after `publish`): wait for the peers, then the rows."""
        return self.kernel.boundary_peers(self.data, self.flags[self.rank], self.mine.epochs,
                                          self.mine.status, residual, post_weight, next_weight,
                                          add_index, eps, config, **self._spin())

    def all_reduce(self, t: Tensor) -> Tensor:
        """FP32 rank-order sum of every rank's `t` [T, H], rounded once (same bits everywhere)."""
        self.publish(t)
        return self.wait_all_reduce(t.shape[0])

    def wait_all_reduce(self, tokens: int) -> Tensor:
        return self.kernel.allreduce_peers(self.data, self.flags[self.rank], self.mine.epochs,
                                           self.mine.status, tokens, **self._spin())

    def check(self) -> None:
        """Raise if a wait of this rank ever gave up on a peer (reads the status: a sync)."""
        bad = int(self.mine.status.item())
        if bad:
            ranks = [r for r in range(self.size) if bad >> r & 1]
            raise P2PError(f"rank {self.rank}: waited past the spin limit for rank(s) {ranks}, "
                           "which never published a row every rank published; the ranks ran "
                           "different sequences of collectives")

    def close(self) -> None:
        self.data, self.flags, self.keep = [], [], []


def simulate_ranks(size: int, capacity: int, hidden: int, device="cpu",
                   kernel: ModuleType | None = None,
                   spin_limit: int | None = None) -> list[PeerView]:
    """Every rank of a group in this process, each with its own buffers (tests, one-GPU runs).
    A rank's calls must come after every peer's publish of the same rows, or its wait times out."""
    kernel = kernel or load_kernel()
    mine = [RankBuffers.allocate(size, capacity, hidden, device) for _ in range(size)]
    views = [b.views() for b in mine]
    return [PeerView(r, mine[r], [v[0] for v in views], [v[1] for v in views], kernel,
                     spin_limit) for r in range(size)]


# ---- the exchange over a process group --------------------------------------------------------
def ipc_handle(t: Tensor) -> dict:
    """What a peer needs to map `t` (a CUDA tensor) into its own address space."""
    info = t.untyped_storage()._share_cuda_()
    return {"info": info, "offset": t.storage_offset(), "numel": t.numel(), "pid": os.getpid()}


def open_ipc(handle: dict, device: torch.device) -> Tensor:
    """A peer's shared uint8 tensor, opened on this rank's GPU (peer access enabled lazily)."""
    # torch opens the handle on the device index it is given (`_share_cuda_`'s first field is
    # the owner's GPU); opening it on our own GPU maps it into our address space without a
    # context on the owner's GPU. The producer synchronized before sharing, so no IPC event.
    info = list(handle["info"])
    info[0] = device.index
    info[-1] = False  # event_sync_required
    storage = torch.UntypedStorage._new_shared_cuda(*info)
    out = torch.empty((0,), dtype=torch.uint8, device=device)
    return out.set_(storage, handle["offset"], (handle["numel"],), (1,))


def exchange(pg, rank: int, size: int, mine: RankBuffers,
             kernel: ModuleType | None = None, spin_limit: int | None = None) -> PeerView:
    """Share this rank's buffer with the group and map every peer's (collective on `pg`).

    Every rank's GPU must reach every peer's (same GPU, or CUDA peer access over NVLink/PCIe);
    P2PError names the pair that cannot."""
    disable_multicast()
    kernel = kernel or load_kernel()
    device = mine.raw.device
    if device.type != "cuda":
        raise P2PError(f"peer-to-peer buffers need CUDA tensors, rank {rank} has {device}")
    torch.cuda.synchronize(device)
    everyone: list[Any] = [None] * size
    dist.all_gather_object(everyone, (device.index, ipc_handle(mine.raw)), group=pg)
    for peer, (index, _) in enumerate(everyone):
        if index != device.index and not torch.cuda.can_device_access_peer(device.index, index):
            raise P2PError(f"rank {rank} (GPU {device.index}) cannot access rank {peer}'s GPU "
                           f"{index} peer-to-peer")
    raws = [mine.raw if peer == rank else open_ipc(handle, device)
            for peer, (_, handle) in enumerate(everyone)]
    views = [mine.views(raw) for raw in raws]
    return PeerView(rank, mine, [v[0] for v in views], [v[1] for v in views], kernel,
                    spin_limit, keep=raws)


# ---- setting the one-shot boundary up for a TP group -----------------------------------------
def setup_oneshot(group, hidden: int, dtype: torch.dtype, capacity: int,
                  reference) -> tuple[PeerView | None, str]:
    """Collective on every rank of `group` (model.parallel.TPGroup): (the view, a note) when the
    one-shot boundary runs here, else (None, why not). `reference(partial, residual, post_w,
    next_w, add_index, eps)` is the gather boundary that the one-shot must equal bitwise; a
    start-up check compares them on every rank, so a group uses it only if all ranks agree."""
    why = _local_reason(group, dtype)
    if group.backend != "nccl":
        return None, why  # the same on every rank: no collective needed to agree
    problems = _gather_text(group, why)
    if problems:
        return None, problems
    view = None
    try:
        view = exchange(group.pg, group.rank, group.size,
                        RankBuffers.allocate(group.size, capacity, hidden, group.device))
        why = ""
    except Exception as exc:  # any rank's failure means the fallback for all of them
        why = f"{type(exc).__name__}: {exc}"
    problems = _gather_text(group, why)
    if not problems:
        problems = _gather_text(group, self_check(view, group, reference))
    if problems:
        if view is not None:
            view.close()
        return None, problems
    return view, (f"one-shot peer-to-peer boundary over {group.size} ranks (CUDA IPC, no "
                  f"multicast; up to {capacity} tokens a call, NCCL all-gather beyond)")


def _local_reason(group, dtype: torch.dtype) -> str:
    if group.backend != "nccl":
        return (f"the {group.backend} group's ranks are not GPUs with peer access: boundaries "
                "use the all-gather fallback")
    if dtype != torch.bfloat16:
        return f"the model is {dtype}; the one-shot kernel is bf16: boundaries use the all-gather"
    kernel_ranks = 8
    if group.size > kernel_ranks:
        return f"{group.size} ranks; the one-shot kernel reads at most {kernel_ranks}"
    return ""


def _gather_text(group, text: str) -> str:
    """'rank r: text' for every rank with a non-empty text (collective)."""
    everyone: list[Any] = [None] * group.size
    dist.all_gather_object(everyone, text, group=group.pg)
    return "; ".join(f"rank {r}: {t}" for r, t in enumerate(everyone) if t)


def self_check(view: PeerView | None, group, reference) -> str:
    """'' when the one-shot boundary and all-reduce equal `reference` bitwise on this rank."""
    if view is None:
        return "no buffers"
    dev, h = group.device, view.hidden
    try:
        for tokens in (1, 3):
            g = torch.Generator(device=dev).manual_seed(1000 + tokens)  # the same on every rank
            residual = torch.randn(tokens, h, generator=g, device=dev).to(torch.bfloat16)
            w = (1 + 0.2 * torch.randn(2, h, generator=g, device=dev)).to(torch.bfloat16)
            mine = torch.Generator(device=dev).manual_seed(7 + 31 * group.rank + tokens)
            partial = torch.randn(tokens, h, generator=mine, device=dev).to(torch.bfloat16)
            args = (residual, w[0], w[1], 2 * tokens + 3, 1e-6)
            got = view.boundary(partial, *args)
            want = reference(partial.clone(), *args)
            total = view.all_reduce(partial)
            from .ops.allreduce_norm_residual_norm import rank_sum

            want_total = rank_sum(group.gather_partials(partial))
            pairs = [*zip(got, want, strict=True), (total, want_total)]
            bad = [i for i, (a, b) in enumerate(pairs) if not torch.equal(a, b)]
            if bad:
                return (f"one-shot outputs {bad} at {tokens} token(s) differ from the all-gather "
                        "reference: boundaries use the all-gather fallback")
        view.check()
    except Exception as exc:  # a kernel that cannot build or run here
        return f"{type(exc).__name__}: {exc}"
    return ""


def simulate_boundary(views: list[PeerView], partials: Tensor, residual: Tensor,
                      post_weight: Tensor, next_weight: Tensor, add_index: int, eps: float,
                      config: dict | None = None) -> list[tuple[Tensor, Tensor]]:
    """One boundary call of every simulated rank: all publish (partials[r]), then all read."""
    for view in views:
        view.publish(partials[view.rank])
    return [view.wait_boundary(residual, post_weight, next_weight, add_index, eps, config)
            for view in views]
