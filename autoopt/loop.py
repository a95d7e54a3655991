"""The optimize loop: profile -> rank ops by gap -> agent sessions -> registry -> e2e -> report.

`optimize(args)` resolves the target (a GPU target needs its GPU, or --proxy), builds the agent
first (a missing API key fails before any work), profiles one step with the tuned set (and once
with the reference set, `profile_reference.json`, for the report), ranks the ops by time above
their floor, and runs one budgeted agent session per op: one evaluation worker per visible GPU
(threads; each worker's candidates are verified and timed in sandboxed child processes on its
own GPU), one worker on the CPU. Every attempt is checkpointed (runstate.py); winners are
registered by loop_eval.py's rule. Then the whole step runs with the new kernel set against the
reference set (output parity and time), and report.py writes `report.md` with plots.

`optimize(resume=run_dir)` continues an interrupted run; replay.py re-evaluates a recorded one.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from . import env
from .agents import Limits, OptimizationTask, default_agent, make_agent, run_session
from .console import make_console
from .loop_eval import HarnessEvaluator, RunContext
from .runstate import RunState

_BUDGET = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*$")


def parse_budget(text: str | float) -> float:
    """'30m' -> 1800.0 seconds; also '90s', '1.5h', or a plain number of seconds."""
    if isinstance(text, int | float):
        return float(text)
    m = _BUDGET.match(str(text))
    if not m:
        raise ValueError(f"budget {text!r} should look like 30m, 90s or 1h")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


@dataclass(frozen=True)
class OptimizeArgs:
    target: str = "cpu-tiny"
    agent: str | None = None  # None: claude with a key, else template
    ops: tuple[str, ...] = ()
    budget_s: float = 1800.0
    max_candidates: int = 4
    proxy: bool = False
    layers: int | None = None
    batch: int | None = None
    auto_accept: bool = False
    registry: str | None = None
    runs_dir: str | None = None
    trials: int = 8  # Optuna trials per token bucket (template agent)
    compile: bool = False  # also time torch.compile of the reference (slow to compile)
    verify_seeds: int = 3
    verify_tokens: tuple[int, ...] = ()  # () = the harness's default verification shapes
    bench_iters: int = 50
    e2e: bool = True
    profile_backend: str = "auto"  # auto (ncu where installed), ncu or torch
    device: str | None = None  # one evaluation worker on this device (default: every GPU)
    model: str | None = None
    max_turns: int | None = None
    max_tokens: int | None = None
    budget_usd: float | None = None

    def __post_init__(self) -> None:
        if self.max_candidates < 1 or self.budget_s <= 0 or self.verify_seeds < 1:
            raise ValueError("max_candidates, budget and verify_seeds must be positive")


def args_from_state(saved: dict, **overrides: Any) -> OptimizeArgs:
    names = {f.name for f in dataclasses.fields(OptimizeArgs)}
    kw = {k: v for k, v in saved.items() if k in names}
    kw.update({k: v for k, v in overrides.items() if v is not None})
    for k in ("ops", "verify_tokens"):
        kw[k] = tuple(kw.get(k) or ())
    return OptimizeArgs(**kw)


def agent_options(args: OptimizeArgs, name: str) -> dict[str, Any]:
    if name == "template":
        return {"trials": args.trials}
    opts = {"model": args.model, "max_turns": args.max_turns, "max_tokens": args.max_tokens,
            "budget_usd": args.budget_usd}
    return {k: v for k, v in opts.items() if v is not None}


def _context(args: OptimizeArgs, target: Any, run_dir: Path, proxy_note: str | None,
             register: bool = True) -> RunContext:
    from model.registry import current_arch, gpu_name

    device = "cpu" if target.hardware.is_cpu else "cuda"
    return RunContext(run_dir=run_dir, registry=env.open_registry(args.registry),
                      target=target, arch=current_arch(device), gpu=gpu_name(device),
                      auto_accept=args.auto_accept, proxy_note=proxy_note, register=register,
                      verify_seeds=tuple(range(args.verify_seeds)),
                      verify_tokens=tuple(args.verify_tokens), compile=args.compile,
                      bench_iters=args.bench_iters, tune_iters=min(20, args.bench_iters))


def _devices(ctx: RunContext, device: str | None = None) -> list[str]:
    if not ctx.meaningful:
        if device not in (None, "cpu"):
            raise ValueError(f"--device {device}: target {ctx.target.name} runs on the cpu")
        return ["cpu"]
    if device is not None:
        if not device.startswith("cuda"):
            raise ValueError(f"--device {device}: target {ctx.target.name} needs a CUDA device "
                             "(cuda or cuda:N)")
        return [device if ":" in device else "cuda:0"]
    import torch

    return [f"cuda:{i}" for i in range(max(1, torch.cuda.device_count()))]


def default_target() -> str:
    """The local GPU's decode target (the first whose GPU matches), else cpu-tiny."""
    import torch

    from .targets import TargetError, gpu_matches, list_targets, load_target

    if not torch.cuda.is_available():
        return "cpu-tiny"
    local = torch.cuda.get_device_name()
    found = [load_target(n) for n in list_targets()]
    found = [t for t in found if not t.hardware.is_cpu and t.phase == "decode"
             and gpu_matches(t.hardware.gpu, local)]
    if found:  # the widest layout first: it is what the model is served with
        return max(found, key=lambda t: t.tp).name
    raise TargetError(f"no target for this GPU ({local}); pick one with --target (autoopt "
                      "targets lists them) and add --proxy to measure at its shapes here")


def bench_shapes(target: Any, op: str) -> list[dict]:
    """The op's shape at each of the target's batch sizes (one per token bucket)."""
    out: list[dict] = []
    for b in target.batch_sizes:
        shape = target.op_shapes(b).get(op)
        if shape and all(int(shape["T"]) != int(s["T"]) for s in out):
            out.append(dict(shape))
    return out


def _current(ctx: RunContext, op: str) -> tuple[str, str, dict]:
    """(name, source, record as JSON) of what this arch's lock runs for `op`, on its evidence."""
    from model.registry.runtime import check_evidence

    reg = ctx.registry
    entry = reg.read_lock().section(ctx.arch).get(op)
    found = check_evidence(reg, op, entry, ctx.arch) if entry else "not locked"
    if isinstance(found, str):
        return "reference", "", {}
    rec = reg.read_record(op, entry.variant)
    return entry.variant, found[1].decode(), rec.to_json()


def build_task(ctx: RunContext, state: RunState, op: str, device: str) -> OptimizationTask:
    row = next((r for r in (state.data["profile"] or {}).get("rows", []) if r["op"] == op), {})
    name, source, record = _current(ctx, op)
    hw = dataclasses.asdict(ctx.target.hardware)
    return OptimizationTask.build(
        op, hardware=hw, shapes=bench_shapes(ctx.target, op), device=device,
        current_name=name, current_source=source, current_record=record, profile_row=row,
        floor_us=row.get("floor_us"), attempts=[a for a, _ in state.attempts(op)])


# ---- the run ------------------------------------------------------------------------------
def optimize(args: OptimizeArgs, console: Console | None = None,
             resume: str | Path | None = None) -> Path:
    """Run (or resume) an optimize run; returns its run directory."""
    from .targets import load_target

    console = console or make_console()
    if resume is not None:
        state = RunState.load(Path(resume))
        args = args_from_state(state.data["args"])
    from model.ops import CONTRACTS

    unknown = sorted(set(args.ops) - set(CONTRACTS))
    if unknown:
        raise ValueError(f"--ops names unknown op(s) {unknown}; known: {', '.join(CONTRACTS)}")
    target = load_target(args.target)
    proxy_note = target.require_local_gpu(args.proxy)
    name = args.agent or default_agent()
    agent = make_agent(name, **agent_options(args, name))  # a missing key fails here
    if target.hardware.is_cpu:
        env.enable_triton_interpreter()
    if resume is None:
        runs = Path(args.runs_dir or env.runs_dir())
        run_dir = runs / f"{time.strftime('%Y%m%d-%H%M%S')}-{target.name}"
        state = RunState.create(run_dir, {**dataclasses.asdict(args), "agent": name},
                                target.name)
    ctx = _context(args, target, state.run_dir, proxy_note)
    console.print(f"[bold]autoopt optimize[/] {target.name} with the {name} agent -> "
                  f"{state.run_dir}" + (f" ({proxy_note})" if proxy_note else ""))
    try:
        if state.data["profile"] is None:
            _profile(args, target, state, console)
        if state.data.get("profile_reference") is None:
            _profile_reference(args, target, state, console)
        if not state.data["ops"]:
            _rank(args, agent, state, console)
        _sessions(args, agent, ctx, state, console)
        if args.e2e and state.data.get("e2e") is None:
            state.set_phase("e2e")
            from .report import end_to_end

            state.update(e2e=end_to_end(ctx, state, args.batch, args.layers, console))
        state.set_phase("done")
    except KeyboardInterrupt:
        state.set_phase("interrupted")
        console.print(f"[yellow]interrupted[/]: resume with autoopt optimize --resume "
                      f"{state.run_dir}")
        raise
    from .report import write_report

    report = write_report(state, ctx)
    console.print(f"report: {report}")
    return state.run_dir


def _profile(args: OptimizeArgs, target: Any, state: RunState, console: Console) -> None:
    from .profiler import profile_step

    state.set_phase("profiling")
    reg = env.open_registry(args.registry)
    if not reg.root.is_dir():  # a new registry: every op's baseline is the reference
        reg.prepare_write()
    registry = reg.root
    with console.status(f"profiling one {target.phase} step of {target.name} (tuned)"):
        prof = profile_step(target, batch=args.batch, layers=args.layers, kernels="tuned",
                            proxy=args.proxy, backend=args.profile_backend, registry=registry)
    from .profiler.report import write_outputs

    write_outputs(prof, state.run_dir, "profile_before")  # autoopt profile --compare reads it
    data = prof.to_dict()
    state.update(profile={"kernels": "tuned", "rows": data["rows"], "step_us": prof.step_us,
                          "gpu": prof.gpu, "batch": prof.batch, "layers": prof.layers,
                          "backend": prof.backend, "meaningful": prof.rates.meaningful})


def _profile_reference(args: OptimizeArgs, target: Any, state: RunState,
                       console: Console) -> None:
    """The reference set's profile (once per run, the before profile's batch, layers and
    backend): the report compares it with the tuned set after the run."""
    from .profiler import profile_step
    from .profiler.report import write_outputs

    state.set_phase("profiling reference")
    with console.status(f"profiling one {target.phase} step of {target.name} (reference)"):
        prof = profile_step(target, batch=args.batch, layers=args.layers, kernels="reference",
                            proxy=args.proxy, backend=args.profile_backend)
    json_path, _ = write_outputs(prof, state.run_dir, "profile_reference")
    state.update(profile_reference=json_path.name)


def _rank(args: OptimizeArgs, agent: Any, state: RunState, console: Console) -> None:
    from model.ops import CONTRACTS

    rows = [r for r in state.data["profile"]["rows"] if r["op"] in CONTRACTS]
    rows.sort(key=lambda r: -(r.get("gap_us") if r.get("gap_us") is not None else r["time_us"]))
    wanted = set(args.ops) if args.ops else None
    ops = []
    for r in rows:
        if wanted is not None and r["op"] not in wanted:
            continue
        status = "pending" if agent.supports(r["op"]) else "skipped"
        ops.append({"op": r["op"], "status": status, "time_us": r["time_us"],
                    "floor_us": r.get("floor_us"), "gap_us": r.get("gap_us"),
                    "note": "" if status == "pending" else f"no {agent.name} proposals for it"})
    state.set_ops(ops)
    listed = ", ".join(o["op"] + ("" if o["status"] == "pending" else "*") for o in ops)
    console.print(f"ops by gap: {listed}  (* skipped: the {agent.name} agent has nothing for it)")


MIN_OP_S = 30.0  # every op gets at least this long from its start: one proposal, evaluated


def _deadline(args: OptimizeArgs, start: float, k: int, n: int, workers: int,
              now: float | None = None) -> float:
    """Op k of n (rank order) on `workers` workers: ops run in rounds, each round an equal share
    of the budget; an op starting late (the ones before it overran) still gets MIN_OP_S, so
    every op is tried at least once and the run overshoots its budget by at most that."""
    rounds = -(-n // workers)
    fair = start + args.budget_s * (k // workers + 1) / rounds
    return fair if now is None else max(fair, now + MIN_OP_S)


def _sessions(args: OptimizeArgs, agent: Any, ctx: RunContext, state: RunState,
              console: Console, mp_context: str = "spawn") -> None:
    state.set_phase("optimizing")
    ops, devices = state.pending_ops(), _devices(ctx, args.device)
    start = time.monotonic()
    console.print(f"{len(ops)} op(s), budget {args.budget_s:.0f} s, {len(devices)} worker(s): "
                  f"{', '.join(devices)}")
    if len(devices) == 1:
        for k, op in enumerate(ops):
            deadline = _deadline(args, start, k, len(ops), 1, time.monotonic())
            _one_op(args, agent, ctx, state, op, devices[0], deadline, console)
        return
    # One process per GPU, each pinned with CUDA_VISIBLE_DEVICES before CUDA starts, so the
    # sandboxed verify/bench children it spawns inherit the same GPU.
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    mpc = mp.get_context(mp_context)
    saved = {**dataclasses.asdict(args), "agent": agent.name}
    with mpc.Manager() as manager, ProcessPoolExecutor(
            len(devices), mp_context=mpc, initializer=_worker_init,
            initargs=(_slots(manager, devices),)) as pool:
        futures = [pool.submit(_worker_op, saved, str(state.run_dir), op,
                               _deadline(args, start, k, len(ops), len(devices)))
                   for k, op in enumerate(ops)]
        for f in futures:
            f.result()
    state.reload()


_WORKER: dict[str, str] = {}


def _slots(manager: Any, devices: list[str]) -> Any:
    q = manager.Queue()
    for d in devices:
        q.put(d)
    return q


def _worker_init(slots: Any) -> None:
    device = slots.get()
    _WORKER["physical"] = device
    if device.startswith("cuda:"):
        os.environ["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
        device = "cuda:0"
    _WORKER["device"] = device


def _worker_op(saved: dict, run_dir: str, op: str, deadline: float) -> str:
    from .targets import load_target

    args = args_from_state(saved)
    agent = make_agent(saved["agent"], **agent_options(args, saved["agent"]))
    target = load_target(args.target)
    ctx = _context(args, target, Path(run_dir), target.require_local_gpu(args.proxy))
    console = make_console()
    console.print(f"worker {os.getpid()} on {_WORKER['physical']}: {op}")
    _one_op(args, agent, ctx, RunState.load(Path(run_dir)), op, _WORKER["device"], deadline,
            console)
    return op


def _one_op(args: OptimizeArgs, agent: Any, ctx: RunContext, state: RunState, op: str,
            device: str, deadline: float, console: Console) -> None:
    task = build_task(ctx, state, op, device)
    state.update_op(op, status="running", device=device, baseline=task.current_name)

    def record(op_name: str, attempt: Any, proposal: dict) -> None:
        state.record_attempt(op_name, attempt, proposal)
        console.print(f"  {op_name} #{attempt.index} {attempt.candidate}: {attempt.verdict}"
                      + (f" ({attempt.reasons[0][:120]})" if attempt.reasons else "")
                      + (f" -> {attempt.outcome}" if attempt.outcome else ""))

    evaluator = HarnessEvaluator(ctx, task, device, task.shapes, record)
    limits = Limits(max_candidates=args.max_candidates, deadline=deadline)
    console.print(f"[bold]{op}[/] on {device}: baseline {task.current_name}, "
                  f"{len(task.attempts)} earlier attempt(s)")
    try:
        with console.status(f"{op}: {agent.name} session on {device} (baseline "
                            f"{task.current_name})"):
            result = run_session(agent, task, evaluator, ctx.run_dir / "ops" / op, limits)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - one op's failure must not end the run
        state.update_op(op, status="error", stop_reason=f"{type(e).__name__}: {e}")
        console.print(f"[red]{op}: session failed: {e}[/]")
        return
    state.update_op(op, status="done", stop_reason=result.stop_reason,
                    session={k: v for k, v in result.summary.items() if k != "stop_reason"})
