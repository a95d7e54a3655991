"""attention triton_v1's split-KV decode under the interpreter: the splits follow the keys each row
sees (not the page table's width), the grid fills the GPU at batch 1, and every combine path (one
split, one group, two levels) gives the reference's output, with stale pages past the context,
before the window and in the padded columns never read, and the tickets back at zero."""

from __future__ import annotations

import pytest
import torch

from autoopt.eval.numerics import ulp_diff_at
from model.ops import contract
from model.registry import Registry


@pytest.fixture(scope="module")
def mod():
    return Registry().load_variant("attention", "triton_v1")


def test_the_grid_fills_132_sms_at_batch_1_and_follows_the_keys(mod):
    # (config SPLITS, T * Hkv, most keys a row can hold, BLOCK_N, MIN_BLOCKS) at 132 SMs
    assert mod.grid_splits(0, 1, 131072, 64, 2, 132) == 128  # bs 1, a max_model_len table
    assert mod.grid_splits(0, 8, 131072, 64, 2, 132) == 32
    assert mod.grid_splits(0, 64, 131072, 64, 2, 132) == 4
    assert mod.grid_splits(0, 1, 512, 64, 2, 132) == 4  # a 512-key window: 4 chunks of 128
    assert mod.grid_splits(0, 1, 1024, 64, 1, 132) == 16  # a short table
    assert mod.grid_splits(16, 1, 131072, 64, 2, 132) == 16  # the config's own
    assert mod.grid_splits(256, 1, 512, 64, 1, 132) == 8  # never past what a row can use
    assert mod.grid_splits(0, 2000, 131072, 64, 2, 132) == 1


def test_each_row_takes_the_splits_its_context_needs(mod):
    # (visible keys, grid splits, BLOCK_N, MIN_BLOCKS) -> splits the row uses
    assert mod.row_splits(512, 128, 64, 2) == 4
    assert mod.row_splits(1024, 128, 64, 2) == 8
    assert mod.row_splits(8192, 128, 64, 2) == 64
    assert mod.row_splits(131072, 128, 64, 2) == 128  # 1024 keys each
    assert mod.row_splits(131073, 128, 64, 2) == 121  # 1088 keys each (whole blocks)
    assert mod.row_splits(1, 128, 64, 2) == 1
    assert mod.row_splits(0, 128, 64, 2) == 1


def _case(batch: int, ctx: int, window: int, page: int, extra: int, seed: int, d: int = 32,
          hq: int = 6, hkv: int = 1) -> tuple:
    """Decode rows at positions ctx-1, ctx-4, ...: each row's visible keys in its own scattered
    pages from its kv_base (the window's first page on window layers), its table padded with
    `extra` columns of the stale page 1; page 1 and every slot before a row's window hold NaN."""
    g = torch.Generator().manual_seed(seed)
    pos = [ctx - 1 - 3 * i for i in range(batch)]
    bases = [max(0, p + 1 - window) // page * page if window else 0 for p in pos]
    need = [-(-(p + 1 - b) // page) for p, b in zip(pos, bases)]
    width = max(need) + extra
    pool = 2 + sum(need)
    perm = (torch.randperm(pool - 2, generator=g) + 2).tolist()
    rows, at = [], 0
    for n in need:
        rows.append(perm[at:at + n] + [1] * (width - n))
        at += n
    shape = (pool, page, hkv, d)
    k = torch.randn(shape, generator=g).to(torch.bfloat16)
    v = torch.randn(shape, generator=g).to(torch.bfloat16)
    k[1], v[1] = float("nan"), float("nan")
    for row, p, b in zip(rows, pos, bases):
        lo = max(b, p + 1 - window) if window else b
        for j in range(b, lo):  # before the window, inside its first page
            k[row[(j - b) // page], (j - b) % page] = float("nan")
            v[row[(j - b) // page], (j - b) % page] = float("nan")
    q = torch.randn(batch, hq, d, generator=g).to(torch.bfloat16)
    long = dict(dtype=torch.long)
    return (q, k, v, torch.tensor(rows, **long), torch.tensor(bases, **long),
            torch.arange(batch, **long), torch.tensor(pos, **long), window, d**-0.5)


CONFIGS = {
    "one split": {"SPLITS": 1, "BLOCK_N": 32},
    "one group": {"SPLITS": 4, "BLOCK_N": 16, "MIN_BLOCKS": 1, "GROUP": 4},
    "two levels": {"SPLITS": 64, "BLOCK_N": 16, "MIN_BLOCKS": 1, "GROUP": 2},
    "default": {},
}
CASES = [  # batch, context, window, page, padded columns
    (1, 300, 0, 16, 40),  # bs 1, a table far wider than the context
    (1, 256, 0, 16, 3),  # the context ends on a page boundary
    (2, 97, 40, 4, 5),  # a window starting inside a page
    (3, 65, 64, 4, 0),  # a window one key short of the context
    (1, 20, 64, 16, 8),  # a window longer than the context
]


@pytest.mark.parametrize("case", CASES, ids=[f"bs{c[0]}-ctx{c[1]}-w{c[2]}-p{c[3]}" for c in CASES])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_combine_path_gives_the_reference(mod, case, name):
    c = contract("attention")
    args = _case(*case, seed=case[1] + len(name))
    ref = c.reference(*args)
    got = mod.run(*args, config=CONFIGS[name])
    assert torch.isfinite(got.float()).all()
    d = ulp_diff_at(got, ref, c.numerics.magnitude(*args)).abs()
    assert int(d.max()) <= 1 and float((d > 0).float().mean()) <= 0.02, (int(d.max()),)
    assert int((got != ref).sum()) < int((got != c.numerics.near_misses["fp32_probs"](*args))
                                         .sum())
    assert torch.equal(mod.run(*args, config=CONFIGS[name]), got)  # deterministic
    assert all(int(t.abs().sum()) == 0 for t in mod._TICKETS.values())  # ready for a replay


def test_the_two_level_combine_runs_where_the_brief_says(mod):
    # The cases above reach every path: 300 keys in chunks of 16 over 64 splits are 19 splits,
    # 10 groups of 2; 4 splits of at least 16 keys fit one group of 4.
    assert mod.row_splits(300, 64, 16, 1) == 19
    assert mod.row_splits(300, 4, 16, 1) == 4
    assert mod.row_splits(20, 1, 32, 1) == 1
