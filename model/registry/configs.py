"""Tuned meta-parameters, keyed by GPU, the op's fixed per-rank dimensions and token bucket.

A config chosen for H200 TP8 decode (rmsnorm at H=5120, swiglu at I=2560 per rank) says nothing
about the same GPU under TP2 (I=12288 per rank, R=2 ranks at the TP boundary): `ConfigKey` keeps
them apart. The dims are the op's tensor dimensions from its SIGNATURE that do not vary from call
to call (T, the bucket axis, and the context S do), read from the call's own arguments at run
time and from a benchmarked shape at tune time, so both sides key the same way.

`ConfigTable.lookup` is the one nearest-bucket rule: the GPU's own entries (else `*`, any GPU),
of these the call's dims (else `*`, any dims: configs migrated from before dims were kept), and
of these the bucket nearest in log2(tokens), the smaller on a tie; no entry -> None (the variant's
DEFAULT_CONFIG). A file looks like
    {"schema": 2, "op": "rmsnorm", "variant": "triton_v1",
     "configs": {"NVIDIA H200": {"H=5120": {"T=1": {"BLOCK": 1024, "num_warps": 4}}}}}
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .names import RegistryError, canonical_json, freeze, sha256_bytes, thaw

BUCKET_AXIS = "T"
ANY = "*"
_DIMS_TEXT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=\d+$")
_BUCKET_TEXT = re.compile(r"^T=(\d+)$")
# Axes whose size changes from call to call of one served model (described so in the contracts'
# AXES: "tokens (varies)", "keys (context)"); a contract may say it outright with VARYING_AXES.
_VARYING_WORDS = re.compile(r"\b(varies|context|tokens)\b")


# ---- which dims key a config ------------------------------------------------------------------
def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        depth += 1 if ch in "[(" else -1 if ch in "])" else 0
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return parts + ([cur.strip()] if cur.strip() else [])


def signature_dims(signature: str) -> tuple[tuple[str, ...] | None, ...]:
    """Per positional argument of `op(a[T,H] bf16, w[H] bf16, eps: float) -> ...`: the dim names
    of a tensor argument (identifiers only; `2I` or `(2*Hq+2*Hkv)*D` are skipped), else None."""
    start = signature.index("(") + 1
    depth, end = 1, start
    while depth and end < len(signature):
        depth += {"(": 1, ")": -1}.get(signature[end], 0)
        end += 1
    out: list[tuple[str, ...] | None] = []
    for arg in _split_top(signature[start:end - 1]):
        m = re.match(r"^\w+\[([^\]]*)\]", arg)
        out.append(tuple(d.strip() for d in m.group(1).split(",")) if m else None)
    return tuple(out)


@functools.cache
def call_axes(op: str) -> tuple[tuple[tuple[int, int, str], ...], tuple[int, int] | None]:
    """((arg index, axis, dim name) of every fixed dim, first occurrence), and where T sits."""
    from model.ops import contract

    c = contract(op)
    varying = set(getattr(c.module, "VARYING_AXES", ())) | {BUCKET_AXIS} | {
        a for a, desc in c.axes.items() if _VARYING_WORDS.search(str(desc))}
    fixed: dict[str, tuple[int, int, str]] = {}
    token: tuple[int, int] | None = None
    for i, dims in enumerate(signature_dims(c.signature)):
        for axis, name in enumerate(dims or ()):
            if name == BUCKET_AXIS and token is None:
                token = (i, axis)
            elif re.fullmatch(r"[A-Za-z_]\w*", name) and name not in varying:
                fixed.setdefault(name, (i, axis, name))
    return tuple(fixed.values()), token


def fixed_dims(op: str, shape: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    """The fixed per-rank dims of a benchmarked/verified `shape` of `op`, sorted by name."""
    names = {name for _, _, name in call_axes(op)[0]}
    return tuple(sorted((k, int(v)) for k, v in shape.items() if k in names))


# ---- keys, entries, tables --------------------------------------------------------------------
@dataclass(frozen=True)
class ConfigKey:
    """Where a tuned config applies: `gpu` (torch's device name, `cpu`, or `*`), `dims` (the op's
    fixed per-rank dims, sorted; None = any, only in migrated files) and the token `bucket`."""

    gpu: str
    dims: tuple[tuple[str, int], ...] | None
    bucket: int

    def __post_init__(self) -> None:
        if not isinstance(self.gpu, str) or not self.gpu.strip():
            raise RegistryError(f"config key GPU {self.gpu!r} must be a device name or '*'")
        if self.dims is not None:
            if list(self.dims) != sorted(self.dims) or any(
                    not isinstance(v, int) or v < 1 for _, v in self.dims):
                raise RegistryError(f"config key dims {self.dims!r} must be sorted (name, size>0)")
        if not isinstance(self.bucket, int) or self.bucket < 0:
            raise RegistryError(f"config bucket {self.bucket!r} must be a token count >= 0")

    @classmethod
    def for_shape(cls, op: str, gpu: str, shape: Mapping[str, int]) -> ConfigKey:
        if BUCKET_AXIS not in shape:
            raise RegistryError(f"shape {dict(shape)} of {op} has no token axis T")
        return cls(gpu, fixed_dims(op, shape), int(shape[BUCKET_AXIS]))

    @property
    def dims_text(self) -> str:
        return ANY if self.dims is None else ",".join(f"{k}={v}" for k, v in self.dims)

    @property
    def bucket_text(self) -> str:
        return f"T={self.bucket}"

    def __str__(self) -> str:
        return f"{self.gpu} {self.dims_text} {self.bucket_text}"


def parse_dims(text: str) -> tuple[tuple[str, int], ...] | None:
    if text == ANY:
        return None
    parts = [p for p in text.split(",") if p] if text else []
    if not all(_DIMS_TEXT.match(p) for p in parts):
        raise RegistryError(f"config dims {text!r} must look like 'H=5120' or 'D=128,Hq=6' "
                            "(or '*')")
    return tuple(sorted((k, int(v)) for k, v in (p.split("=") for p in parts)))


def parse_bucket(text: str) -> int:
    m = _BUCKET_TEXT.match(text)
    if not m:
        raise RegistryError(f"config bucket {text!r} must look like 'T=8'")
    return int(m.group(1))


@dataclass(frozen=True)
class ConfigEntry:
    key: ConfigKey
    config: Mapping[str, Any]

    def __post_init__(self) -> None:
        if not isinstance(self.config, Mapping):
            raise RegistryError(f"config at {self.key} must be a mapping, got {self.config!r}")
        object.__setattr__(self, "config", freeze(self.config))


@dataclass(frozen=True)
class ConfigTable:
    """A variant's tuned configs (immutable; `merged` returns a new table)."""

    entries: tuple[ConfigEntry, ...] = ()

    def __post_init__(self) -> None:
        keys = [e.key for e in self.entries]
        if len(set(keys)) != len(keys):
            raise RegistryError("a config table names one key twice")
        order = sorted(self.entries, key=lambda e: (e.key.gpu, e.key.dims_text, e.key.bucket))
        object.__setattr__(self, "entries", tuple(order))

    def __bool__(self) -> bool:
        return bool(self.entries)

    def lookup(self, gpu: str, dims: Sequence[tuple[str, int]], tokens: int
               ) -> Mapping[str, Any] | None:
        """The nearest-bucket rule (module docstring); None: no entry applies."""
        dims = tuple(sorted(dims))
        for g in (gpu, ANY):
            on_gpu = [e for e in self.entries if e.key.gpu == g]
            for d in (dims, None):
                group = [e for e in on_gpu if e.key.dims == d]
                if group:
                    t = math.log2(max(tokens, 1))
                    best = min(group, key=lambda e: (abs(math.log2(max(e.key.bucket, 1)) - t),
                                                     e.key.bucket))
                    return best.config
        return None

    def merged(self, new: Iterable[ConfigEntry]) -> ConfigTable:
        """This table with `new` in place of every entry of the (GPU, dims) groups it tunes."""
        new = tuple(new)
        groups = {(e.key.gpu, e.key.dims) for e in new}
        kept = [e for e in self.entries if (e.key.gpu, e.key.dims) not in groups]
        return ConfigTable(tuple(kept) + new)

    @property
    def sha256(self) -> str:
        """The hash a lock entry pins: over the entries, not the file's bytes or layout."""
        return sha256_bytes(canonical_json(self.to_json()).encode())

    def to_json(self) -> dict[str, dict[str, dict[str, dict]]]:
        out: dict[str, dict[str, dict[str, dict]]] = {}
        for e in self.entries:
            out.setdefault(e.key.gpu, {}).setdefault(e.key.dims_text, {})[e.key.bucket_text] = \
                thaw(e.config)
        return out

    @classmethod
    def from_json(cls, data: Any, where: str = "configs") -> ConfigTable:
        if not isinstance(data, Mapping):
            raise RegistryError(f"{where} must map GPU name -> dims -> 'T=<n>' -> config")
        entries = []
        for gpu, by_dims in data.items():
            if not isinstance(by_dims, Mapping):
                raise RegistryError(f"{where}[{gpu!r}] must map dims ('H=5120') -> buckets")
            for dims, buckets in by_dims.items():
                if not isinstance(buckets, Mapping):
                    raise RegistryError(f"{where}[{gpu!r}][{dims!r}] must map 'T=<n>' -> config")
                for b, cfg in buckets.items():
                    key = ConfigKey(str(gpu), parse_dims(str(dims)), parse_bucket(str(b)))
                    entries.append(ConfigEntry(key, cfg))
        return cls(tuple(entries))

    @classmethod
    def from_rows(cls, op: str, gpu: str, rows: Iterable[Mapping[str, Any]]) -> ConfigTable:
        """Configs exactly as benchmarked: one entry per timed shape; a shape timed with the
        default config gets an explicit {} so the nearest-bucket rule cannot hand it another
        bucket's config that was never timed there."""
        return cls(tuple(ConfigEntry(ConfigKey.for_shape(op, gpu, r["shape"]),
                                     dict(r.get("config") or {})) for r in rows))
