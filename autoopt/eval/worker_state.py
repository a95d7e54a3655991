"""The worker's view of a candidate's state: a digest per module-level name of everything the
candidate keeps between calls.

A kernel that keeps a count of its calls (in a list, a closure cell, an object's attribute, an
iterator's position, a generator, a module-level tensor a kernel adds to) can be exact for as
many calls as any verification makes and wrong after: no number of judged calls catches it. What
gives it away is that its state changes on every call, while an honest variant's does not once
the inputs repeat: caches keyed by shape, device or pointer are filled by the first call, and a
workspace is rewritten with the same contents by the same call. The judge compares digests
taken after two calls on the same held inputs, and after a call on new data then the same inputs
again (`followups.keeps_state`).

The walk reads the candidate's module globals and, from them, builtin containers, the
candidate's own functions (defaults, closure cells, attributes), bound methods, partials,
instances and classes defined in the candidate's file (their `__dict__`, read without calling
any of the candidate's code), builtin and itertools iterators (their pickled position),
generators (frame position and locals), torch generators (their state), `lru_cache` wrappers
(misses and size: hits count calls, and reading them is refused by the static screen) and the
whole storage behind every tensor it meets (so bytes past a view's end count too); and torch's
global generators (CPU, and the worker's GPU), from which an honest kernel draws nothing. A
library object (a Triton kernel object, a FlashInfer wrapper) is walked one level deep: its own
attributes' values, containers and tensors, and the candidate's function it wraps, not the
library objects it holds (their caches are keyed by what the call looks like).
"""

from __future__ import annotations

import collections
import functools
import hashlib
import types
import warnings
from typing import Any

import torch

_type = type
_MAX_OBJECTS = 50_000
_SCALARS = (int, float, complex, bool, str, bytes, type(None), type(Ellipsis))
_CONTAINERS = (list, tuple, set, frozenset, collections.deque)
# Builtin iterators and itertools objects: their position is what `__reduce__` gives back.
_ITER_MODULES = frozenset({"builtins", "itertools"})
_LIBRARIES = ("torch", "triton", "numpy", "cutlass", "flashinfer", "functools", "collections",
              "typing", "enum", "dataclasses")


def digest(module: Any, run: Any, device: str = "cpu") -> dict[str, str]:
    """A digest per module-level name (or of `run` alone where there is no module: a trusted
    in-process candidate, whose every function and class outside the libraries is walked)."""
    roots = ({k: v for k, v in dict.items(vars(module)) if not k.startswith("__")}
             if module is not None else {"run": run})
    path = getattr(module, "__file__", None) if module is not None else None
    owner = module.__name__ if module is not None else None
    budget = [_MAX_OBJECTS]
    storages: dict[tuple, bytes] = {}
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # itertools pickling is deprecated in 3.12
        for name in sorted(roots):
            h = hashlib.blake2b(digest_size=12)
            # Each name walked on its own: what changes is put down to the name that holds it.
            walk = _Walk(h, {}, budget, path, owner)
            walk.storages = storages
            walk.feed(roots[name], 0)
            out[name] = h.hexdigest()
    # The global generators: an honest kernel draws nothing from them, and a candidate that does
    # can be wrong on a random one call in a thousand, which few judged calls would see.
    gens = [("<torch's global generator>", torch.default_generator)]
    if device.startswith("cuda"):
        index = torch.device(device).index
        gens.append(("<torch's global cuda generator>",
                     torch.cuda.default_generators[index if index is not None else 0]))
    for name, gen in gens:
        h = hashlib.blake2b(gen.get_state().numpy().tobytes(), digest_size=12)
        out[name] = h.hexdigest()
    if budget[0] <= 0:
        out["<too many objects>"] = str(_MAX_OBJECTS)
    return out


class _Walk:
    def __init__(self, h: Any, seen: dict[int, tuple], budget: list[int], path: str | None,
                 module: str | None) -> None:
        self.h, self.seen, self.budget = h, seen, budget
        self.path, self.module = path, module
        self.shallow = False  # inside a library object's attributes
        self.storages: dict[tuple, bytes] = {}  # one digest per storage, however often met

    def put(self, *parts: Any) -> None:
        for p in parts:
            self.h.update(p if isinstance(p, bytes) else str(p).encode())
            self.h.update(b"\x1f")

    def own(self, obj: Any) -> bool:
        """Defined in the candidate's file (for an in-process candidate: outside the libraries)."""
        if isinstance(obj, types.FunctionType):
            return self.module is None or obj.__code__.co_filename == self.path
        cls = obj if isinstance(obj, type) else _type(obj)
        name = str(type.__dict__["__module__"].__get__(cls))
        if self.module is None:
            return name != "builtins" and not name.startswith(_LIBRARIES)
        return name == self.module

    def feed(self, obj: Any, depth: int) -> None:
        t = _type(obj)
        if t in _SCALARS:
            self.put(t.__name__, repr(obj))
            return
        key = id(obj)
        if key in self.seen:  # shared or cyclic: by its first position
            self.put("ref", self.seen[key][0])
            return
        self.budget[0] -= 1
        if self.budget[0] <= 0 or depth > 64:
            self.put("cut")
            return
        # The object is kept alive with its position: a copy made for the walk (a dict of an
        # object's attributes) freed early would leave its id to an unrelated object.
        self.seen[key] = (len(self.seen), obj)
        self.put(t.__module__, t.__qualname__)
        if isinstance(obj, types.ModuleType):
            self.put(obj.__name__)
        elif isinstance(obj, torch.Tensor):
            self._tensor(obj)
        elif isinstance(obj, torch.Generator):
            self.put(obj.device)
            self._tensor(obj.get_state())
        elif isinstance(obj, dict):
            items = list(dict.items(obj))  # not a subclass's own `items`
            self.put(len(items))
            for k, v in items:
                self.feed(k, depth + 1)
                self.feed(v, depth + 1)
        elif isinstance(obj, _CONTAINERS):
            items = list(obj)
            if isinstance(obj, set | frozenset):
                items.sort(key=lambda x: (_type(x).__qualname__, repr(x) if _type(x) in
                                          _SCALARS else ""))
            self.put(len(items))
            for v in items:
                self.feed(v, depth + 1)
        elif isinstance(obj, bytearray | memoryview):
            self.put(bytes(obj))
        elif isinstance(obj, types.FunctionType):
            self._function(obj, depth)
        elif isinstance(obj, types.MethodType):
            self.feed(obj.__self__, depth + 1)
            self.feed(obj.__func__, depth + 1)
        elif isinstance(obj, functools.partial):
            self.feed(obj.func, depth + 1)
            self.feed(obj.args, depth + 1)
            self.feed(obj.keywords, depth + 1)
        elif t.__qualname__ == "_lru_cache_wrapper":
            info = obj.cache_info()
            self.put(info.misses, info.currsize)
            self.feed(getattr(obj, "__wrapped__", None), depth + 1)
        elif isinstance(obj, types.GeneratorType | types.CoroutineType | types.AsyncGeneratorType):
            frame = getattr(obj, "gi_frame", None) or getattr(obj, "cr_frame", None) or \
                getattr(obj, "ag_frame", None)
            self.put("running" if frame is None else frame.f_lasti)
            if frame is not None:
                self.feed(dict(frame.f_locals), depth + 1)
        elif isinstance(obj, type):
            if self.own(obj):
                for k, v in list(dict.items(dict(obj.__dict__))):
                    if k not in ("__dict__", "__weakref__", "__doc__", "__module__"):
                        self.put(k)
                        self.feed(v, depth + 1)
        elif isinstance(obj, staticmethod | classmethod):
            self.feed(obj.__func__, depth + 1)
        elif isinstance(obj, property):
            for f in (obj.fget, obj.fset, obj.fdel):
                self.feed(f, depth + 1)
        elif t.__module__ in _ITER_MODULES:
            try:
                state = obj.__reduce__()
            except Exception:  # noqa: BLE001 - not picklable: its repr is all there is
                self.put(repr(obj))
            else:
                self.feed(state[1:] if isinstance(state, tuple) else state, depth + 1)
        else:
            self._object(obj, depth)

    def _tensor(self, t: torch.Tensor) -> None:
        self.put(t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.device)
        if t.is_meta or t.layout is not torch.strided:
            return
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr(), storage.nbytes())
        if key not in self.storages:
            whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            self.storages[key] = hashlib.blake2b(whole.detach().cpu().numpy().tobytes(),
                                                 digest_size=16).digest()
        self.put(self.storages[key])

    def _function(self, fn: types.FunctionType, depth: int) -> None:
        self.put(fn.__qualname__)
        if not self.own(fn):
            return
        shallow, self.shallow = self.shallow, False  # the candidate's own: all of it
        try:
            self._own_function(fn, depth)
        finally:
            self.shallow = shallow

    def _own_function(self, fn: types.FunctionType, depth: int) -> None:
        self.feed(fn.__defaults__, depth + 1)
        self.feed(fn.__kwdefaults__, depth + 1)
        self.feed(dict(fn.__dict__), depth + 1)
        for cell in fn.__closure__ or ():
            try:
                self.feed(cell.cell_contents, depth + 1)
            except ValueError:  # an empty cell
                self.put("empty")

    def _object(self, obj: Any, depth: int) -> None:
        """An instance: all of its attributes if its class is the candidate's. A library
        object's own attributes (a Triton kernel's, a FlashInfer wrapper's) one level deep:
        values, containers and tensors, and any candidate function (a kernel's `fn`), but not
        the library objects they hold (a compiled kernel, a stream): a count a candidate hangs
        on a kernel object shows, a library's inner workings are not walked."""
        try:
            attrs = object.__getattribute__(obj, "__dict__")
        except AttributeError:
            attrs = None
        if not isinstance(attrs, dict):
            return
        if self.own(_type(obj)):
            self.feed(dict(dict.items(attrs)), depth + 1)
        elif not self.shallow:
            self.shallow = True
            try:
                self.feed(dict(dict.items(attrs)), depth + 1)
            finally:
                self.shallow = False
