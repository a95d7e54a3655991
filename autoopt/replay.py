"""`autoopt optimize --replay RUN_DIR`: re-evaluate a recorded run's proposals, no agent.

Every recorded candidate file is verified and timed again with the configs it was proposed with
(on this machine, this harness), in a new run directory `<time>-<target>-replay`, with the
registry untouched; the result says, per attempt, whether the verdict reproduces. Use it to
reproduce a run on another GPU or to re-check old proposals after a harness change.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console

from . import env
from .agents import Proposal
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
    rows, same = [], True
    for op in [o["op"] for o in src.data["ops"]]:
        task = build_task(ctx, state, op, device)
        evaluator = HarnessEvaluator(ctx, task, device, task.shapes, state.record_attempt)
        for attempt, prop in src.attempts(op):
            cand = Path(run_dir) / "ops" / op / "candidates" / f"{attempt.candidate}.py"
            fields = {k: prop.get(k) for k in ("name_hint", "config_space", "notes", "config",
                                                "configs", "parent", "meta") if k in prop}
            proposal = Proposal(source=cand.read_text(), **{k: v for k, v in fields.items()
                                                            if v is not None})
            new = evaluator.evaluate(proposal, index=attempt.index).attempt
            task.attempts.append(new)
            ok = new.verdict == attempt.verdict
            same &= ok
            rows.append({"op": op, "candidate": attempt.candidate, "recorded": attempt.verdict,
                         "replayed": new.verdict, "reproduced": ok,
                         "recorded_reasons": list(attempt.reasons),
                         "replayed_reasons": list(new.reasons)})
            console.print(f"  {op} {attempt.candidate}: recorded {attempt.verdict}, replayed "
                          f"{new.verdict} {'ok' if ok else '[red]DIFFERS[/]'}")
        state.update_op(op, status="done")
    state.update(replay={"of": str(run_dir), "rows": rows, "all_reproduced": same})
    state.set_phase("done")
    (out / "replay.json").write_text(json.dumps(state.data["replay"], indent=1))
    return out, same
