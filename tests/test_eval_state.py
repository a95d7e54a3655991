"""The worker's digest of what a candidate keeps between calls (autoopt/eval/worker_state.py), and
the judge's check that it does not change from call to call (followups.keeps_state)."""

from __future__ import annotations

import functools
import itertools
import types

import torch

from autoopt.eval.worker_state import digest

_SOURCE_HONEST = '''
import torch

CACHE = {}
LIMITS = (1, 2, 3)


class Plan:
    def __init__(self, n):
        self.n = n


def _workspace(x):
    key = (tuple(x.shape), x.dtype)
    if key not in CACHE:
        CACHE[key] = (torch.zeros(x.numel(), dtype=torch.float32), Plan(x.shape[0]))
    return CACHE[key][0]


def run(x, config=None):
    ws = _workspace(x)
    ws.copy_(x.float().reshape(-1))  # rewritten with what this call determines
    return (ws * 2).reshape(x.shape).to(x.dtype)
'''


def _module(source: str, name: str = "cand") -> types.ModuleType:
    m = types.ModuleType(name)
    m.__file__ = f"/nowhere/{name}.py"
    exec(compile(source, m.__file__, "exec"), m.__dict__)
    return m


def _changed(m: types.ModuleType, *args) -> list[str]:
    m.run(*args)
    a = digest(m, m.run)
    m.run(*args)
    b = digest(m, m.run)
    return sorted(k for k in a if a[k] != b.get(k))


def test_an_honest_module_with_caches_and_a_workspace_keeps_the_same_state():
    m = _module(_SOURCE_HONEST)
    x = torch.randn(3, 5)
    assert _changed(m, x) == []
    y = torch.randn(4, 5)  # a new shape adds a cache entry; after that it holds still
    m.run(y)
    assert _changed(m, y) == []


def test_counts_kept_anywhere_change_the_digest_of_the_name_that_holds_them():
    counters = {
        "closure": '''
def _make():
    box = [0]
    def run(x, config=None):
        box[0] += 1
        return x
    return run
run = _make()''',
        "list": '''
SEEN = []
def run(x, config=None):
    SEEN.append(None)
    return x''',
        "iterator": '''
TICKS = iter(range(10**9))
def run(x, config=None):
    next(TICKS)
    return x''',
        "itertools": '''
import itertools
TICKS = itertools.count()
def run(x, config=None):
    next(TICKS)
    return x''',
        "generator": '''
def _gen():
    n = 0
    while True:
        n += 1
        yield n
G = _gen()
def run(x, config=None):
    next(G)
    return x''',
        "instance": '''
class K:
    def go(self, x, config=None):
        self.calls = getattr(self, "calls", 0) + 1
        return x
run = K().go''',
        "class attribute": '''
class K:
    calls = [0]
def run(x, config=None):
    K.calls[0] = K.calls[0] + 1
    return x''',
        "default argument": '''
def run(x, config=None, _n={"n": 0}):
    _n["n"] = _n["n"] + 1
    return x''',
        "device counter": '''
import torch
COUNT = torch.zeros(1, dtype=torch.int32)
def run(x, config=None):
    COUNT.add_(1)
    return x''',
        "past a view's end": '''
import torch
_BUF = torch.zeros(8)
VIEW = _BUF[:4]
def run(x, config=None):
    _BUF[6] += 1
    return x''',
        "generator object": '''
import torch
G = torch.Generator().manual_seed(0)
def run(x, config=None):
    torch.rand(1, generator=G)
    return x''',
        "hung on a library object": '''
import functools
def _helper(v):
    return v
P = functools.partial(_helper)
class Lib:  # stands for a kernel object from a library (walked one level deep)
    pass
Lib.__module__ = "triton.runtime.jit"
KERNEL = Lib()
KERNEL.cache = {}
def run(x, config=None):
    KERNEL.cache[len(KERNEL.cache)] = None
    return x''',
    }
    x = torch.randn(2, 3)
    for what, source in counters.items():
        m = _module(source)
        changed = _changed(m, x)
        assert changed, what
        assert all(not k.startswith("<") for k in changed), (what, changed)


def test_drawing_from_torchs_global_generator_changes_the_digest():
    m = types.ModuleType("cand")
    m.run = lambda x, config=None: x + torch.rand(()) * 0
    assert _changed(m, torch.randn(2)) == ["<torch's global generator>"]


def test_the_walk_never_runs_candidate_code():
    calls = []

    class Sneaky:
        @property
        def tell(self):  # a property reading the walk would run
            calls.append("property")
            return 1

        def items(self):
            calls.append("items")
            return []

    class SneakyDict(dict):
        def items(self):
            calls.append("dict.items")
            return []

    m = types.ModuleType("cand")
    m.OBJ, m.D = Sneaky(), SneakyDict(a=1)
    m.run = lambda x, config=None: x
    digest(m, m.run)
    assert calls == []
    before = digest(m, m.run)
    dict.__setitem__(m.D, "b", 2)  # its own items() would hide this
    assert digest(m, m.run)["D"] != before["D"]


def test_lru_cache_hits_do_not_count_but_new_entries_do():
    @functools.cache
    def config_for(t):
        return {"BLOCK": 64 if t < 16 else 128}

    m = types.ModuleType("cand")
    m.config_for = config_for
    m.run = lambda x, config=None: (config_for(x.shape[0]), x)[1]
    x = torch.randn(2, 3)
    assert _changed(m, x) == []
    m.run(torch.randn(40, 3))
    before = digest(m, m.run)
    m.run(torch.randn(41, 3))
    assert digest(m, m.run)["config_for"] != before["config_for"]


def test_cycles_and_big_structures_are_bounded():
    m = types.ModuleType("cand")
    a = []
    a.append(a)
    m.A = a
    m.run = lambda x, config=None: x
    assert "<too many objects>" not in digest(m, m.run)
    m.BIG = [[i] for i in range(60_000)]  # a count could hide behind the walk's bound
    d = digest(m, m.run)
    assert set(d) >= {"A", "BIG", "run", "<too many objects>"}


def test_itertools_and_range_positions_are_read():
    m = types.ModuleType("cand")
    m.C, m.R = itertools.count(5), iter(range(3))
    m.run = lambda x, config=None: x
    before = digest(m, m.run)
    next(m.C)
    after = digest(m, m.run)
    assert before["C"] != after["C"] and before["R"] == after["R"]
    next(m.R)
    assert digest(m, m.run)["R"] != after["R"]


def _honest_swiglu(gate, up):
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(gate.dtype)


def test_a_session_rejects_a_count_no_verification_reaches_and_passes_the_honest_op():
    from tests.test_eval_trials import session

    def counting():
        box = [0]

        def run(gate, up):
            box[0] += 1
            return _honest_swiglu(gate, up) if box[0] <= 10**9 else gate

        return run

    def counting_changes():  # a repeated input is not counted
        seen = {"last": None, "n": 0}

        def run(gate, up):
            sample = float(gate.float().sum()) if gate.numel() else 0.0
            if sample != seen["last"]:
                seen["last"], seen["n"] = sample, seen["n"] + 1
            return _honest_swiglu(gate, up) if seen["n"] <= 10**9 else gate

        return run

    reasons = session("swiglu", counting(), state=True)[0]
    assert any("keeps state that changes from call to call" in r and
               "after two calls on the same inputs" in r for r in reasons), reasons
    reasons = session("swiglu", counting_changes(), state=True)[0]
    assert any("keeps state that changes from call to call" in r and
               "after a call on other data" in r for r in reasons), reasons
    assert session("swiglu", _honest_swiglu, state=True)[0] == []


def test_the_digest_is_the_same_when_nothing_changed():
    # Copies made during the walk (each function's attribute dict) are freed as it goes; an id
    # reused by the next copy must not read as "already seen".
    src = "\n".join(f"def f{i}(x):\n    return x\n" for i in range(40))
    src += "\nPATHS = {" + ", ".join(f"'p{i}': f{i}" for i in range(40)) + "}\n"
    src += "TABLE = [(f1, {'k': [f2, f3]}), (f4, {})]\ndef run(x, config=None):\n    return x\n"
    m = _module(src)
    first = digest(m, m.run)
    assert all(digest(m, m.run) == first for _ in range(5))
