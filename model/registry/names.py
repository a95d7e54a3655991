"""Names, hashes and frozen JSON values shared by every part of the registry.

A registry is plain files written by people and agents, so every name that becomes a path or a
TOML key is checked here, every hash is a 64-digit lowercase sha256, and records are deep-frozen
(mappings become read-only views, lists tuples) so a record read at load time cannot be mutated
by whoever holds it.
"""

from __future__ import annotations

import hashlib
import json
import re
import types
from collections.abc import Mapping
from typing import Any

NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
SHA = re.compile(r"^[0-9a-f]{64}$")
ARCH = re.compile(r"^(sm_\d{2,3}a?|cpu)$")


class RegistryError(ValueError):
    """A registry operation that cannot be done: says what was wrong and what to do."""


class KernelRefusedWarning(UserWarning):
    """A locked variant was refused at load time; its op runs the reference."""


def check_name(kind: str, name: object) -> str:
    if not isinstance(name, str) or not NAME.match(name):
        raise RegistryError(f"{kind} name {name!r} is not a plain identifier (letters, digits, "
                            "underscores; not starting with a digit)")
    return name


def check_sha(kind: str, sha: object) -> str:
    if not isinstance(sha, str) or not SHA.match(sha):
        raise RegistryError(f"{kind} {sha!r} is not a sha256 (64 lowercase hex digits)")
    return sha


def check_arch(arch: object) -> str:
    if not isinstance(arch, str) or not ARCH.match(arch):
        raise RegistryError(f"arch {arch!r} should look like sm_90, sm_100 or cpu")
    return arch


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def freeze(value: Any) -> Any:
    """A deep read-only copy of a JSON value: dicts -> MappingProxyType, lists -> tuples."""
    if isinstance(value, Mapping):
        return types.MappingProxyType({str(k): freeze(v) for k, v in value.items()})
    if isinstance(value, list | tuple):
        return tuple(freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """The plain JSON value of a frozen one (for writing and for callers that edit a copy)."""
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [thaw(v) for v in value]
    return value


def canonical_json(value: Any) -> str:
    """One text per value (sorted keys, no spaces): what a hash of JSON data is taken over."""
    return json.dumps(thaw(value), sort_keys=True, separators=(",", ":"), default=str)


def dump_json(value: Any) -> str:
    """How registry files are written: stable key order within the schema, indented."""
    return json.dumps(thaw(value), indent=2, default=str) + "\n"
