"""The judge <-> worker protocol: framed JSON messages over a Unix socket, tensors in an arena.

A message is a 4-byte big-endian length and that many bytes of UTF-8 JSON (never pickle: the
judge must not execute anything the worker sends). Tensor data travels through an *arena*: a
memfd that the judge creates and hands to the worker (SCM_RIGHTS), so the worker sees no file
name and holds only what it was given. A tensor in the arena is described by `TensorDesc`
(offset, byte count, dtype name, shape); the side that reads a description validates it against
the arena before touching the bytes. Imported by both sides: keep it free of judge state.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import socket
import struct
from dataclasses import dataclass
from typing import Any

import torch

_LEN = struct.Struct("!I")
MAX_MESSAGE = 16 << 20
ALIGN = 256
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32, "int16": torch.int16,
    "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class ProtocolError(RuntimeError):
    """A malformed message or tensor description (the other side misbehaved)."""


def send(sock: socket.socket, obj: dict, fds: tuple[int, ...] = ()) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    if len(data) > MAX_MESSAGE:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE}")
    payload = _LEN.pack(len(data)) + data
    if fds:
        socket.send_fds(sock, [payload], list(fds))
    else:
        sock.sendall(payload)


def recv(sock: socket.socket, want_fds: int = 0) -> tuple[dict, list[int]]:
    """One message (and up to `want_fds` file descriptors sent with it)."""
    fds: list[int] = []
    if want_fds:
        head, fds, _flags, _addr = socket.recv_fds(sock, _LEN.size, want_fds)
        head += _exactly(sock, _LEN.size - len(head)) if 0 < len(head) < _LEN.size else b""
        if not head:
            raise EOFError("peer closed the connection")
    else:
        head = _exactly(sock, _LEN.size)
    (n,) = _LEN.unpack(head)
    if n > MAX_MESSAGE:
        raise ProtocolError(f"message length {n} exceeds {MAX_MESSAGE}")
    try:
        obj = json.loads(_exactly(sock, n))
    except ValueError as e:
        raise ProtocolError(f"message is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(f"message is {type(obj).__name__}, expected an object")
    return obj, fds


def _exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("peer closed the connection")
        buf += chunk
    return bytes(buf)


@dataclass(frozen=True)
class TensorDesc:
    off: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]

    def to_json(self) -> dict:
        return {"off": self.off, "nbytes": self.nbytes, "dtype": self.dtype,
                "shape": list(self.shape)}

    @classmethod
    def parse(cls, obj: Any, arena_size: int) -> TensorDesc:
        """Validated description: known dtype, sane shape, bytes inside the arena."""
        if not isinstance(obj, dict):
            raise ProtocolError(f"tensor description is {type(obj).__name__}")
        off, nbytes, dtype, shape = (obj.get(k) for k in ("off", "nbytes", "dtype", "shape"))
        if dtype not in DTYPES:
            raise ProtocolError(f"unknown dtype {dtype!r}")
        if not (isinstance(shape, list) and len(shape) <= 8 and all(
                isinstance(d, int) and 0 <= d < 1 << 40 for d in shape)):
            raise ProtocolError(f"bad shape {shape!r}")
        size = math.prod(shape) * DTYPES[dtype].itemsize
        if not (isinstance(off, int) and isinstance(nbytes, int) and nbytes == size
                and 0 <= off and off + nbytes <= arena_size):
            raise ProtocolError(f"tensor bytes [{off}, +{nbytes}) of a {dtype}{shape} do not fit "
                                f"an arena of {arena_size} bytes")
        return cls(off, nbytes, dtype, tuple(shape))


class Arena:
    """A memfd mapped read-write; tensors are copied in and out at aligned offsets."""

    def __init__(self, size: int, fd: int | None = None) -> None:
        self.size = max(int(size), mmap.PAGESIZE)
        self.fd = os.memfd_create("arena", os.MFD_CLOEXEC) if fd is None else fd
        if fd is None:
            os.ftruncate(self.fd, self.size)
        self.mm = mmap.mmap(self.fd, self.size)

    def close(self) -> None:
        self.mm.close()
        os.close(self.fd)

    def view(self, desc: TensorDesc) -> torch.Tensor:
        """A tensor over the arena bytes (no copy; valid while the arena is open)."""
        raw = torch.frombuffer(self.mm, dtype=torch.uint8, count=desc.nbytes, offset=desc.off) \
            if desc.nbytes else torch.empty(0, dtype=torch.uint8)
        return raw.view(DTYPES[desc.dtype]).reshape(desc.shape)

    def write(self, t: torch.Tensor, off: int) -> TensorDesc:
        t = t.detach()
        desc = TensorDesc(off, t.numel() * t.element_size(), DTYPE_NAMES[t.dtype],
                          tuple(t.shape))
        if desc.off + desc.nbytes > self.size:
            raise ProtocolError(f"{desc.nbytes} bytes at {off} overflow the arena ({self.size})")
        if desc.nbytes:
            self.view(desc).copy_(t.reshape(desc.shape))
        return desc

    def read(self, desc: TensorDesc) -> torch.Tensor:
        """A private copy of the bytes described (the other side may keep writing the arena)."""
        return self.view(desc).clone()


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN
