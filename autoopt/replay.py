"""`autoopt optimize --replay RUN_DIR`: re-evaluate a recorded run's proposals, no agent service.

In a new run directory `<time>-<target>-replay`, with the registry untouched, on this machine's
harness: an agent that declares a replayer (the Claude agent: `AgentSpec.replay`) has each
recorded session re-run from its transcript without a key, every tool answered and every
submission judged anew; for any other agent (the template agent's proposals are the project's
own templates) every recorded candidate file is verified and timed again with the configs it was
proposed with. The result says, per submission, whether the recorded verdict is reproduced. Use
it to reproduce a run on another GPU or to re-check old proposals after a harness change.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from . import env
from .agents import Proposal, spec
from .console import make_console
from .loop import _context, _devices, args_from_state, build_task
from .loop_eval import HarnessEvaluator
from .runstate import RunState


def replay(run_dir: str | Path, console: Console | None = None, registry: str | None = None,
           runs_dir: str | None = None) -> tuple[Path, bool]:
    """Re-evaluate a recorded run's proposals without any agent; (replay dir, all reproduced)."""
    from .targets import load_target

    console = console or make_console()
    src = RunState.load(Path(run_dir))
    args = args_from_state(src.data["args"], registry=registry)
    target = load_target(args.target)
    proxy_note = target.require_local_gpu(args.proxy)
    if target.hardware.is_cpu:
        env.enable_triton_interpreter()
    out = Path(runs_dir or Path(run_dir).parent) / (
        f"{time.strftime('%Y%m%d-%H%M%S')}-{target.name}-replay")
    state = RunState.create(out, {**src.data["args"], "replay_of": str(run_dir)}, target.name)
    state.update(profile=src.data["profile"])
    state.set_ops([{"op": o["op"], "status": "pending"} for o in src.data["ops"]])
    ctx = _context(args, target, out, proxy_note, register=False)
    device = _devices(ctx, args.device)[0]
    replayer = spec(src.data["args"].get("agent") or "template").replay
    rows: list[dict] = []
    for op in [o["op"] for o in src.data["ops"]]:
        def make(op: str = op) -> tuple[Any, HarnessEvaluator]:
            task = build_task(ctx, state, op, device)
            return task, HarnessEvaluator(ctx, task, device, task.shapes, state.record_attempt)

        op_dir = Path(run_dir) / "ops" / op
        if replayer is not None and op_dir.is_dir():
            got = replayer(op_dir, make, out / "ops" / op,
                           lambda name, op=op: _recorded(src, op, name))
        else:
            got = _candidates(src, Path(run_dir), op, make)
        for r in got:
            console.print(f"  {op} {r.get('session', '')} {r.get('candidate')}: recorded "
                          f"{r['recorded']}, replayed {r['replayed']} "
                          f"{'ok' if r['reproduced'] else '[red]DIFFERS[/]'}")
        rows += got
        state.update_op(op, status="done")
    same = all(r["reproduced"] for r in rows)
    state.update(replay={"of": str(run_dir), "rows": rows, "all_reproduced": same})
    state.set_phase("done")
    (out / "replay.json").write_text(json.dumps(state.data["replay"], indent=1))
    return out, same


def _recorded(src: RunState, op: str, session: str) -> list[str]:
    """The verdicts the run recorded for one session, in order of submission."""
    return [a.verdict for a, p in src.attempts(op) if (p.get("meta") or {}).get("session")
            == session]


def _candidates(src: RunState, run_dir: Path, op: str, make: Any) -> list[dict]:
    task, evaluator = make()
    rows = []
    for attempt, prop in src.attempts(op):
        cand = run_dir / "ops" / op / "candidates" / f"{attempt.candidate}.py"
        fields = {k: prop.get(k) for k in ("name_hint", "config_space", "notes", "config",
                                            "configs", "parent", "meta", "language", "trusted")
                  if k in prop}
        proposal = Proposal(source=cand.read_text(), **{k: v for k, v in fields.items()
                                                        if v is not None})
        new = evaluator.evaluate(proposal, index=attempt.index).attempt
        task.attempts.append(new)
        rows.append({"op": op, "candidate": attempt.candidate, "recorded": attempt.verdict,
                     "replayed": new.verdict, "reproduced": new.verdict == attempt.verdict,
                     "recorded_reasons": list(attempt.reasons),
                     "replayed_reasons": list(new.reasons)})
    return rows
