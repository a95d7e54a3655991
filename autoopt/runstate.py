"""The optimize run's checkpoint: `state.json` (rewritten atomically) and `attempts.jsonl`.

Both are written after every attempt, and a proposal being evaluated waits beside its candidate
file as `<candidate>.pending.json` until its attempt is recorded. A crash, a kill or Ctrl-C
(SIGTERM stops a run as Ctrl-C does: its workers stopped, its state "interrupted") loses at most
the time of the evaluation in flight: `autoopt optimize --resume RUN_DIR`
evaluates the pending proposals first (one interrupted twice is recorded as an error instead),
then continues from the next op or proposal.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from autoopt.agents.base import Attempt

STATE = "state.json"
ATTEMPTS = "attempts.jsonl"
VERSION = 1


class RunState:
    def __init__(self, run_dir: Path, data: dict) -> None:
        self.run_dir, self.data = Path(run_dir), data
        self._lock = threading.Lock()

    # ---- creation and loading ---------------------------------------------------------------
    @classmethod
    def create(cls, run_dir: Path, args: Mapping[str, Any], target: str) -> RunState:
        base, n = Path(run_dir), 1
        while run_dir.exists():  # two runs started within the same second
            n += 1
            run_dir = base.with_name(f"{base.name}-{n}")
        run_dir.mkdir(parents=True)
        st = cls(run_dir, {"version": VERSION, "target": target, "args": dict(args),
                           "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "phase": "started",
                           "profile": None, "ops": [], "events": []})
        st.save()
        return st

    @classmethod
    def load(cls, run_dir: Path) -> RunState:
        path = Path(run_dir) / STATE
        if not path.is_file():
            raise FileNotFoundError(f"{run_dir} is not an optimize run directory (no {STATE}); "
                                    "pass the directory `autoopt optimize` printed")
        data = json.loads(path.read_text())
        if data.get("version") != VERSION:
            raise ValueError(f"{path} has state version {data.get('version')}, expected "
                             f"{VERSION}: it was written by another autoopt version")
        return cls(Path(run_dir), data)

    def save(self) -> None:  # callers hold the lock (or own the run, as at creation)
        path = self.run_dir / STATE
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, path)  # atomic: a crash leaves the old or the new state, never half

    # ---- ops and attempts (several worker processes may write: file lock + reload) ---------
    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict]:
        with self._lock, open(self.run_dir / "state.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                path = self.run_dir / STATE
                if path.is_file():
                    self.data = json.loads(path.read_text())
                yield self.data
                self.save()
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def reload(self) -> None:
        self.data = json.loads((self.run_dir / STATE).read_text())

    def _mutate(self, fn: Callable[[dict], None]) -> None:
        with self._locked() as data:
            fn(data)

    def set_phase(self, phase: str) -> None:
        def change(d: dict) -> None:
            d["phase"] = phase
            _event(d, f"phase {phase}")

        self._mutate(change)

    def set_ops(self, ops: list[dict]) -> None:
        self._mutate(lambda d: d.update(ops=[{**o, "status": o.get("status", "pending")}
                                             for o in ops]))

    def op(self, name: str) -> dict:
        return _op(self.data, name)

    def update_op(self, name: str, **fields: Any) -> None:
        self._mutate(lambda d: _op(d, name).update(fields))

    def update(self, **fields: Any) -> None:
        self._mutate(lambda d: d.update(fields))

    def record_attempt(self, op: str, attempt: Attempt, proposal: Mapping[str, Any]) -> None:
        line = json.dumps({"attempt": attempt.to_dict(), "proposal": dict(proposal)},
                          default=str)

        def change(d: dict) -> None:
            with (self.run_dir / ATTEMPTS).open("a") as f:
                f.write(line + "\n")
                f.flush()
                os.fsync(f.fileno())
            entry = _op(d, op)
            entry["attempts"] = entry.get("attempts", 0) + 1
            if attempt.outcome.startswith("registered"):
                entry.setdefault("registered", []).append(
                    {"variant": attempt.outcome.split()[1].split("/", 1)[-1],
                     "speedup": attempt.speedup, "candidate": attempt.candidate})
            _event(d, f"{op} attempt {attempt.index}: {attempt.verdict} {attempt.outcome}")

        self._mutate(change)

    def attempts(self, op: str | None = None) -> list[tuple[Attempt, dict]]:
        path = self.run_dir / ATTEMPTS
        if not path.is_file():
            return []
        out = []
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by a crash mid-write: that attempt is redone
            a = Attempt.from_dict(d["attempt"])
            if op is None or a.op == op:
                out.append((a, d.get("proposal", {})))
        return out

    def pending_ops(self) -> list[str]:
        return [o["op"] for o in self.data["ops"] if o["status"] not in ("done", "skipped")]

    def winners(self) -> dict[str, dict]:
        """Per op, the registered variant of this run with the best speedup."""
        out = {}
        for o in self.data["ops"]:
            regs = o.get("registered") or []
            if regs:
                out[o["op"]] = max(regs, key=lambda r: r.get("speedup") or 0.0)
        return out


def _op(data: dict, name: str) -> dict:
    for o in data["ops"]:
        if o["op"] == name:
            return o
    raise KeyError(f"op {name!r} is not part of this run")


def _event(data: dict, text: str) -> None:
    data["events"].append({"time": time.strftime("%H:%M:%S"), "text": text})
