"""Jobs for the farm tests: one that reports where it ran, one whose first worker dies."""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar


@dataclass(frozen=True)
class WhereJob:
    """Returns the worker's pid and the device it was given."""

    kind: ClassVar[str] = "where"
    op: str = "swiglu"

    def run(self, device: str) -> dict:
        return {"device": device, "interpret": os.environ.get("TRITON_INTERPRET")}


@dataclass(frozen=True)
class DiesOnce:
    """Kills its own worker process the first time it runs (a lost worker: SIGKILL, as the OOM
    killer or a dead node would), then, run again elsewhere, does `inner`'s work."""

    marker: str
    inner: object = None
    kind: ClassVar[str] = "dies-once"
    op: str = "swiglu"

    def run(self, device: str) -> dict:
        mark = Path(self.marker)
        if not mark.exists():
            mark.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        out = self.inner.run(device) if self.inner is not None else {}
        return {**out, "killed_pid": int(mark.read_text()), "device": device}
