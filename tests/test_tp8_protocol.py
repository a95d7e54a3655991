"""The one-shot boundary's barrier: every interleaving of the ranks, checked exhaustively.

A model of what kernels/allreduce_norm_residual_norm/oneshot_v1.py does per row (rows of one
kernel run in any order; a rank's kernels run in stream order; each release store of a flag
becomes visible to its peer on its own):
    publish, rank i, row t:  e = epochs[t] + 1; data_i[e % 2][t] = call; then flags_j[i, t] = e
                             for every rank j, in any order
    row program, rank i:     wait until flags_i[j, t] >= epochs[t] for every j; read
                             data_j[epochs[t] % 2][t] for every j (begin ... end)
Every reachable state is visited: a read must see each rank's partial of its own call, unchanged
until the read ends, and the ranks must never wedge. The same search finds the bugs of a protocol
with one slot (a rank a call ahead overwrites what a peer still reads) or without the wait.
Then the real kernels run the protocol in real processes: gloo ranks on CPU share their buffers
(shared memory) and spin in the Triton interpreter on each other's flags.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from model import p2p
from model.ops import allreduce_norm_residual_norm as arn
from model.parallel import TPGroup, launch


@dataclass(frozen=True)
class Protocol:
    ranks: int
    tokens: tuple[int, ...]  # rows of each call, the same on every rank
    slots: int = 2
    wait: bool = True


def _start(p: Protocol):
    rows, r = max(p.tokens), p.ranks
    progress = tuple((0, "publish", (0,) * rows) for _ in range(r))
    epochs = tuple((0,) * rows for _ in range(r))
    data = tuple(tuple((-1,) * rows for _ in range(p.slots)) for _ in range(r))
    flags = tuple(tuple((0,) * rows for _ in range(r)) for _ in range(r))
    return progress, epochs, data, flags


def _set(tup: tuple, index: int, value) -> tuple:
    return tup[:index] + (value,) + tup[index + 1:]


def _steps(p: Protocol, state):
    """(next state, violation or None) for every step any rank can take."""
    progress, epochs, data, flags = state
    full = (1 << (p.ranks + 1)) - 1  # written + every flag sent
    for i, (call, phase, rows) in enumerate(progress):
        if call == len(p.tokens):
            continue
        for t in range(p.tokens[call]):
            e, prog = epochs[i][t], rows[t]
            if phase == "publish" and not prog & 1:
                e += 1
                slot = e % p.slots
                nd = _set(data, i, _set(data[i], slot, _set(data[i][slot], t, call)))
                yield _advance(p, i, t, prog | 1, (progress, _set(epochs, i, _set(
                    epochs[i], t, e)), nd, flags)), None
            elif phase == "publish" and prog != full:
                for j in range(p.ranks):
                    if not prog >> (j + 1) & 1:
                        nf = _set(flags, j, _set(flags[j], i, _set(flags[j][i], t, e)))
                        yield _advance(p, i, t, prog | 1 << (j + 1),
                                       (progress, epochs, data, nf)), None
            elif phase == "read" and prog < 2:
                if prog == 0 and p.wait and any(flags[i][j][t] < e for j in range(p.ranks)):
                    continue  # still waiting
                seen = [data[j][e % p.slots][t] for j in range(p.ranks)]
                bad = None
                if any(s != call for s in seen):
                    what = "saw" if prog == 0 else "had its row overwritten by"
                    bad = f"rank {i} call {call} row {t} {what} calls {seen}"
                yield _advance(p, i, t, prog + 1, state), bad


def _advance(p: Protocol, i: int, t: int, prog: int, state):
    progress, epochs, data, flags = state
    call, phase, rows = progress[i]
    rows = _set(rows, t, prog)
    n = p.tokens[call]
    if phase == "publish" and all(r == (1 << (p.ranks + 1)) - 1 for r in rows[:n]):
        mine = (call, "read", (0,) * len(rows))  # the next kernel on the rank's stream
    elif phase == "read" and all(r == 2 for r in rows[:n]):
        mine = (call + 1, "publish", (0,) * len(rows))
    else:
        mine = (call, phase, rows)
    return _set(progress, i, mine), epochs, data, flags


def explore(p: Protocol, limit: int = 400_000) -> tuple[int, list[str]]:
    """(states visited, violations found) over every interleaving."""
    start = _start(p)
    seen, stack, bad = {start}, [start], []
    while stack:
        state = stack.pop()
        moves = list(_steps(p, state))
        if not moves and any(c < len(p.tokens) for c, _, _ in state[0]):
            bad.append(f"deadlock at {state[0]}")
        for nxt, violation in moves:
            if violation:
                bad.append(violation)
                continue
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
        if len(seen) > limit:
            raise AssertionError(f"more than {limit} states: shrink the protocol")
    return len(seen), bad


# Rows that skip calls (2, 1, 2: row 1 alternates slots on its own), long runs, three ranks.
# (Three ranks with two rows is ~600k states, ~75 s: run by hand when changing the protocol.)
@pytest.mark.parametrize("proto", [
    Protocol(2, (2, 1, 2, 2)), Protocol(2, (1, 2, 1, 2, 2, 1)), Protocol(2, (1, 1, 1, 1, 1)),
    Protocol(3, (1, 1, 1, 1)),
], ids=str)
def test_every_interleaving_reads_its_own_call(proto):
    states, bad = explore(proto)
    assert bad == [] and states > 100


@pytest.mark.parametrize("proto,what", [
    # A rank a call ahead has already overwritten the one slot: its peer sees the next call.
    (Protocol(2, (1, 1, 1), slots=1), "saw calls [0, 1]"),
    (Protocol(2, (1, 1), wait=False), "saw calls [-1, 0]"),  # read before the peer wrote
], ids=["one-slot", "no-wait"])
def test_the_search_finds_a_broken_protocol(proto, what):
    _, bad = explore(proto)
    assert any(what in b for b in bad), bad[:3]


# ---- the real kernels in real processes -----------------------------------------------------
TOKENS = [3, 1, 4, 2, 4, 1]
HIDDEN = 64


def _rank_calls(group: TPGroup, buffers: list[p2p.RankBuffers]) -> list:
    """This rank's boundaries and all-reduces over the shared buffers, call after call."""
    views = [b.views() for b in buffers]
    view = p2p.PeerView(group.rank, buffers[group.rank], [v[0] for v in views],
                        [v[1] for v in views], p2p.load_kernel(), spin_limit=200_000)
    out = []
    for i, t in enumerate(TOKENS):
        partials, *rest = arn.make_inputs({"R": group.size, "T": t, "H": HIDDEN}, seed=40 + i)
        if i % 2:
            out.append((view.all_reduce(partials[group.rank]),))
        else:
            out.append(view.boundary(partials[group.rank], *rest))
    view.check()
    return out


@pytest.mark.slow
def test_processes_spin_on_each_others_flags():
    """Three gloo ranks (real processes) over buffers in shared memory: each waits in the
    interpreted kernel for the others' flags; every rank gets the stacked op's bits."""
    from model.registry import Registry

    ranks, capacity = 3, max(TOKENS)
    buffers = [p2p.RankBuffers.allocate(ranks, capacity, HIDDEN, "cpu") for _ in range(ranks)]
    for b in buffers:  # before any view exists: the ranks map the same pages
        b.raw.share_memory_()
    got = launch(_rank_calls, ranks, args=(buffers,), timeout_s=600)
    v1 = Registry().load_variant(arn.NAME, "triton_v1")
    for i, t in enumerate(TOKENS):
        partials, *rest = arn.make_inputs({"R": ranks, "T": t, "H": HIDDEN}, seed=40 + i)
        want = (arn.rank_sum(partials),) if i % 2 else v1.run(partials, *rest)
        for rank in range(ranks):
            assert all(torch.equal(a, b) for a, b in zip(got[rank][i], want, strict=True)), (
                f"call {i}, rank {rank}")
