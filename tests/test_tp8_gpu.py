"""The one-shot boundary on GPUs: simulated ranks on one GPU, real processes sharing one GPU
through CUDA IPC, and NCCL groups over 2 or 8 GPUs (skipped where there are fewer).

On one GPU a "peer" buffer is local memory, so these check the arithmetic (bitwise against
triton_v1 and the op's reference), the device-side epochs under CUDA-graph replay, and the IPC
exchange and barrier between real processes; NVLink itself needs two GPUs or more.
"""

from __future__ import annotations

import pytest
import torch

from model import p2p
from model.config import preset
from model.ops import allreduce_norm_residual_norm as arn
from model.parallel import TPGroup, attach, launch
from model.registry import Registry

pytestmark = pytest.mark.gpu
TOKENS = [1, 8, 64, 2048]


def _equal(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("ranks", [2, 3, 8])
def test_simulated_ranks_on_one_gpu_are_bitwise(ranks):
    v1 = Registry().load_variant(arn.NAME, "triton_v1")
    views = p2p.simulate_ranks(ranks, max(TOKENS), 5120, "cuda")
    for i, t in enumerate(TOKENS + [3, 2048, 1]):
        args = arn.make_inputs({"R": ranks, "T": t, "H": 5120}, seed=i, device="cuda")
        want = arn.reference(*args)
        assert _equal(v1.run(*args), want)
        for got in p2p.simulate_boundary(views, *args):
            assert _equal(got, want), f"T={t}"
        partials = args[0]
        for view in views:
            view.publish(partials[view.rank])
        for view in views:
            assert torch.equal(view.wait_all_reduce(t), arn.rank_sum(partials))
    for view in views:
        view.check()


def test_graph_replay_advances_the_epochs():
    ranks, t = 4, 8
    views = p2p.simulate_ranks(ranks, 16, 5120, "cuda")
    static = [arn.make_inputs({"R": ranks, "T": t, "H": 5120}, seed=0, device="cuda")
              for _ in range(2)]
    p2p.simulate_boundary(views, *static[0])  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [p2p.simulate_boundary(views, *args) for args in static]
    for seed in (1, 2, 3):
        for k, args in enumerate(static):
            fresh = arn.make_inputs({"R": ranks, "T": t, "H": 5120}, seed=10 * seed + k,
                                    device="cuda")
            for dst, src in zip(args, fresh, strict=True):
                if torch.is_tensor(dst):
                    dst.copy_(src)
        graph.replay()
        for args, per_rank in zip(static, outs, strict=True):
            want = arn.reference(*args)
            assert all(_equal(got, want) for got in per_rank)
    # 1 eager call + 2 captured calls x 3 replays on each of the first t rows.
    assert views[0].mine.epochs[:t].tolist() == [7] * t
    for view in views:
        view.check()


def _ipc_rank(group: TPGroup, calls: list[int]) -> list:
    """A gloo rank whose buffers live on GPU 0, shared with the others through CUDA IPC."""
    dev = torch.device("cuda", 0)
    view = p2p.exchange(group.pg, group.rank, group.size,
                        p2p.RankBuffers.allocate(group.size, max(calls), 5120, dev))
    out = []
    for i, t in enumerate(calls):
        partials, *rest = arn.make_inputs({"R": group.size, "T": t, "H": 5120}, seed=i,
                                          device=dev)
        out.append([x.cpu() for x in view.boundary(partials[group.rank], *rest)])
    view.check()
    return out


@pytest.mark.parametrize("ranks", [2, 3])
def test_processes_share_one_gpu_through_ipc(ranks):
    calls = [1, 8, 3, 64, 8]
    got = launch(_ipc_rank, ranks, "gloo", args=(calls,), timeout_s=300)
    for i, t in enumerate(calls):
        want = arn.reference(*arn.make_inputs({"R": ranks, "T": t, "H": 5120}, seed=i,
                                              device="cuda"))
        for rank in range(ranks):
            assert _equal(got[rank][i], [w.cpu() for w in want]), f"call {i}, rank {rank}"


def _nccl_rank(group: TPGroup) -> dict:
    from model.tp_ranks import random_rank_model

    cfg = preset("beam-1.0-501b").replace(num_hidden_layers=4, vocab_size=16384,
                                          num_experts=16, moe_intermediate_size=1024)
    model = attach(random_rank_model(cfg, group.size, group.rank, group.device), group)
    ids = torch.tensor([[7, 100, 200, 300, 1500, 2047, 9]], device=group.device)
    oneshot = model(ids).cpu()
    if group.peers is not None:
        group.peers.check()
    group.boundary_impl = "gather"
    gather = model(ids).cpu()
    return {"note": group.boundary_note, "equal": torch.equal(oneshot, gather),
            "logits": oneshot}


@pytest.mark.parametrize("tp", [2, 8])
def test_nccl_oneshot_equals_gather(tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs")
    ranks = launch(_nccl_rank, tp, "nccl", timeout_s=600)
    for r in ranks:
        assert "one-shot peer-to-peer boundary" in r["note"] and r["equal"]
        assert torch.equal(r["logits"], ranks[0]["logits"])
