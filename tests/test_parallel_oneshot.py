"""The "oneshot" boundary inside real TP groups on CPU: its start-up decision and its use.

gloo ranks have no CUDA IPC, so these tests stand in for it: the ranks' buffers live in shared
memory and `p2p.exchange` is replaced by a function that maps them, and the group says "nccl" to
the set-up (its process group stays gloo). Everything else is the product's path: `attach` sets
the boundary up collectively, the start-up check compares it with the all-gather boundary on
every rank, and the model's boundaries and embedding sum run the one-shot kernels (Triton
interpreter) while the ranks spin on each other's flags.
"""

from __future__ import annotations

import pytest
import torch

from model import p2p
from model.config import preset
from model.parallel import TPGroup, attach, launch
from model.tp_ranks import random_rank_model

CONFIG = preset("tiny").replace(num_attention_heads=8, num_hidden_layers=4)
IDS = torch.tensor([[7, 100, 200, 300, 1500, 2047, 9]])
CAPACITY = 8

pytestmark = pytest.mark.slow


def _shared_buffers(ranks: int) -> list[p2p.RankBuffers]:
    buffers = [p2p.RankBuffers.allocate(ranks, CAPACITY, CONFIG.hidden_size, "cpu")
               for _ in range(ranks)]
    for b in buffers:
        b.raw.share_memory_()
    return buffers


class _OffByOne:
    """A kernel module whose boundary is one bf16 ulp off in one element (a wrong kernel)."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def boundary_peers(self, *args, **kwargs):
        normed, new_res = self.kernel.boundary_peers(*args, **kwargs)
        bits = normed.view(torch.int16).clone()
        bits[0, 0] += 1
        return bits.view(torch.bfloat16), new_res


def _rank(group: TPGroup, buffers, how: str) -> dict:
    def fake_exchange(pg, rank, size, mine, kernel=None, spin_limit=None):
        if how == "fails on rank 1" and rank == 1:
            raise RuntimeError("no peer access from here")
        views = [b.views() for b in buffers]
        k = p2p.load_kernel()
        return p2p.PeerView(rank, buffers[rank], [v[0] for v in views], [v[1] for v in views],
                            _OffByOne(k) if how == "wrong kernel" else k, 400_000)

    p2p.exchange = fake_exchange  # this rank process only
    group.backend, group.boundary_impl = "nccl", "oneshot"
    model = attach(random_rank_model(CONFIG, group.size, group.rank, "cpu", seed=1), group,
                   max_tokens=CAPACITY)
    out = {"note": group.boundary_note, "peers": group.peers is not None,
           "oneshot": model(IDS)}
    calls = int(group.peers.mine.epochs[0]) if group.peers is not None else 0
    group.boundary_impl = "gather"
    out["gather"] = model(IDS)
    out["epochs_row0"] = calls
    return out


def test_the_group_runs_the_one_shot_boundary_bitwise():
    ranks = launch(_rank, 2, args=(_shared_buffers(2), "works"), timeout_s=900)
    for r in ranks:
        assert r["peers"] and "one-shot peer-to-peer boundary over 2 ranks" in r["note"]
        assert torch.equal(r["oneshot"], r["gather"]) and torch.equal(r["oneshot"],
                                                                       ranks[0]["oneshot"])
        # Row 0 of every call: the start-up check (2 boundaries + 2 sums), then one forward's
        # embedding sum and 2 boundaries per layer.
        assert r["epochs_row0"] == 4 + 1 + 2 * CONFIG.num_hidden_layers


@pytest.mark.parametrize("how,why", [
    ("fails on rank 1", "rank 1: RuntimeError: no peer access from here"),
    ("wrong kernel", "one-shot outputs [0] at 1 token(s) differ from the all-gather reference"),
])
def test_any_rank_that_cannot_makes_every_rank_fall_back(how, why):
    ranks = launch(_rank, 2, args=(_shared_buffers(2), how), timeout_s=900)
    for r in ranks:
        assert not r["peers"] and why in r["note"], r["note"]
        assert torch.equal(r["oneshot"], r["gather"])
