"""The optimize loop: plan -> profile the served step -> rank -> agents -> bench model -> report.

`optimize(args)` resolves the target (a GPU target needs its GPU, or --proxy), builds the agent
first (a missing API key fails before any work; its options are the ones it declares, parsed by
`autoopt.agents.parse_options`) and plans the whole command within `--budget` (budget.py: the
plan is printed up front, every stage has a deadline). It profiles the step as the server runs
it (the engine, the paged KV cache, CUDA graphs, the tuned set) at each of the target's batch
sizes the plan covers, ranks the ops by their time above their floor summed over those batch
sizes, and runs `--sessions N` agent sessions per op at once (threads in this process, each with
its own seed or strategy). Every candidate goes to the run's evaluation farm (autoopt/farm): one
worker per local GPU (`--gpus`), each candidate verified and timed alone on its GPU; on the CPU
`--workers` workers that verify and never time; or Ray tasks pinned to one GPU each
(`--ray-address`). Ops run as many at a time as there are workers, each with an equal share of
the sessions' time. The run state, every registry write, the ledger of what the run spends
(tokens and USD of the API, device seconds; logged as it goes) and the report stay here. Every
attempt is checkpointed (runstate.py); winners are registered by loop_eval.py's rule, with
configs tuned for every token bucket the target serves. The end-to-end check is `bench model`
(reference vs tuned vs the run's new set, parity of their outputs), and report.py writes
`report.md` whose headline is ms per step against the floor, per batch size. Progress goes to
`run.log` in the run directory and to stderr as plain timestamped lines.

`optimize(resume=run_dir)` continues an interrupted run; replay.py re-evaluates a recorded one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import re
import signal
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from . import env
from .agents import (
    Limits,
    OptimizationTask,
    SessionContext,
    default_agent,
    make_agent,
    parse_options,
    run_session,
)
from .budget import Ledger, plan_run
from .console import make_console
from .loop_eval import HarnessEvaluator, RunContext
from .runlog import run_log, say, stage
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
    compile: bool = False  # also time torch.compile of the reference (slow to compile)
    verify_seeds: int = 3
    verify_tokens: tuple[int, ...] = ()  # () = the harness's default verification shapes
    bench_iters: int = 50
    e2e: bool = True
    profile_backend: str = "auto"  # auto/torch: torch.profiler; ncu adds a sampled Nsight pass
    device: str | None = None  # one evaluation worker on this device (default: every GPU)
    agent_options: Mapping[str, Any] = field(default_factory=dict)  # declared by the agent
    sessions: int = 1  # agent sessions per op, at once
    gpus: tuple[int, ...] = ()  # local GPUs that evaluate (default: every visible one)
    workers: int = 1  # evaluation workers on a CPU run (verify only)
    ray_address: str | None = None  # evaluate on a Ray cluster ("local": start one here)

    def __post_init__(self) -> None:
        if self.max_candidates < 1 or self.budget_s <= 0 or self.verify_seeds < 1:
            raise ValueError("max_candidates, budget and verify_seeds must be positive")
        if self.sessions < 1 or self.workers < 1:
            raise ValueError("--sessions and --workers must be >= 1")
        if self.gpus and self.device:
            raise ValueError("give --gpus or --device, not both")


def args_from_state(saved: dict, **overrides: Any) -> OptimizeArgs:
    names = {f.name for f in dataclasses.fields(OptimizeArgs)}
    kw = {k: v for k, v in saved.items() if k in names}
    kw.update({k: v for k, v in overrides.items() if v is not None})
    for k in ("ops", "verify_tokens", "gpus"):
        kw[k] = tuple(kw.get(k) or ())
    kw["agent_options"] = dict(kw.get("agent_options") or {})
    return OptimizeArgs(**kw)


def agent_options(args: OptimizeArgs, name: str) -> dict[str, Any]:
    """The options agent `name` declares, from the run's generic option dict."""
    return parse_options(name, args.agent_options)


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


def _devices(ctx: RunContext, device: str | None = None,
             gpus: tuple[int, ...] = ()) -> list[str]:
    """The local evaluation devices: cpu on a CPU target; else --device, --gpus or every GPU."""
    if not ctx.meaningful:
        if device not in (None, "cpu") or gpus:
            raise ValueError(f"--device/--gpus: target {ctx.target.name} runs on the cpu "
                             "(use --workers for several CPU workers)")
        return ["cpu"]
    if device is not None:
        if not device.startswith("cuda"):
            raise ValueError(f"--device {device}: target {ctx.target.name} needs a CUDA device "
                             "(cuda or cuda:N)")
        return [device if ":" in device else "cuda:0"]
    import torch

    count = max(1, torch.cuda.device_count())
    if gpus:
        bad = [g for g in gpus if not 0 <= g < count]
        if bad:
            raise ValueError(f"--gpus {bad}: this machine has GPUs 0..{count - 1}")
        return [f"cuda:{g}" for g in gpus]
    return [f"cuda:{i}" for i in range(count)]


def farm_spec(args: OptimizeArgs, ctx: RunContext) -> Any:
    """Where this run's candidates are evaluated (autoopt/farm)."""
    from .farm import FarmSpec

    devices = _devices(ctx, args.device, args.gpus)
    if not ctx.meaningful:
        devices = ["cpu"] * args.workers
    return FarmSpec(devices=tuple(devices), ray_address=args.ray_address, gpu=ctx.meaningful)


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


def served_batches(target: Any) -> tuple[int, ...]:
    """Batch sizes whose token counts the target's steps run ops at (Target.token_buckets:
    the decode graph buckets, or the prefill batch sizes)."""
    return target.token_buckets() if target.phase == "decode" else tuple(target.batch_sizes)


def bench_shapes(target: Any, op: str) -> list[dict]:
    """The op's shape at every token bucket the target serves (tuned configs are kept per
    bucket: a bucket left untuned would run another bucket's config, never timed there)."""
    out: list[dict] = []
    for b in served_batches(target):
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
    entry = next((o for o in state.data["ops"] if o["op"] == op), {})
    row = {k: entry[k] for k in ("time_us", "floor_us", "gap_us", "by_batch") if k in entry}
    name, source, record = _current(ctx, op)
    hw = dataclasses.asdict(ctx.target.hardware)
    return OptimizationTask.build(
        op, hardware=hw, shapes=bench_shapes(ctx.target, op), device=device,
        current_name=name, current_source=source, current_record=record, profile_row=row,
        floor_us=row.get("floor_us"), attempts=[a for a, _ in state.attempts(op)])


# ---- the run ------------------------------------------------------------------------------
def optimize(args: OptimizeArgs, console: Console | None = None,
             resume: str | Path | None = None, clock: Any = time.monotonic) -> Path:
    """Run (or resume) an optimize run within its budget; returns its run directory."""
    from .targets import load_target

    start = clock()
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
    with run_log(state.run_dir / "run.log"), sigterm_interrupts():
        return _run(args, target, agent, state, proxy_note, console, start, clock)


@contextlib.contextmanager
def sigterm_interrupts():
    """SIGTERM (a batch scheduler's or `timeout`'s stop) ends the run as Ctrl-C does: the farm
    stops its workers (a judge's worker holds GPU memory), the state says "interrupted" and the
    log says how to resume. Only in the main thread, where Python runs signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"stopped by signal {signum}")

    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _run(args: OptimizeArgs, target: Any, agent: Any, state: RunState, proxy_note: str | None,
         console: Console, start: float, clock: Any) -> Path:
    ctx = _context(args, target, state.run_dir, proxy_note)
    batches = (args.batch,) if args.batch else tuple(target.batch_sizes)
    plan = plan_run(args.budget_s, "cpu" if not ctx.meaningful else "gpu", batches, args.e2e,
                    compile=args.compile and ctx.meaningful)
    ends = plan.deadlines(start)
    say(f"autoopt optimize {target.name} with the {agent.name} agent -> {state.run_dir}"
        + (f" ({proxy_note})" if proxy_note else ""))
    for line in plan.describe():
        say(line)
    state.update(plan={"budget_s": plan.budget_s, "profile_batches": list(plan.profile_batches),
                       "e2e_batches": list(plan.e2e_batches),
                       "stages": [dataclasses.asdict(s) for s in plan.stages]})
    try:
        if state.data["profile"] is None:
            with stage("profile"):
                _profile(args, target, state, plan.profile_batches, ends["profile"])
        if not state.data["ops"]:
            _rank(args, agent, state)
        with stage("sessions"):
            _sessions(args, agent, ctx, state, console, ends["sessions"],
                      (plan.min_op_s, plan.min_start_s), clock=clock)
        if plan.e2e_batches and state.data.get("e2e") is None:
            state.set_phase("e2e")
            from .report import end_to_end

            with stage("end-to-end check (bench model)"):
                state.update(e2e=end_to_end(ctx, state, plan.e2e_batches, args.layers,
                                            ends["e2e"], clock))
        state.set_phase("done")
    except KeyboardInterrupt as e:
        state.set_phase("interrupted")
        say(f"interrupted ({e or 'Ctrl-C'}): resume with autoopt optimize --resume "
            f"{state.run_dir}")
        console.print(f"[yellow]interrupted[/]: resume with autoopt optimize --resume "
                      f"{state.run_dir}")
        raise
    from .report import write_report

    with stage("report"):
        report = write_report(state, ctx)
    say(f"report: {report} ({clock() - start:.0f} s of a {args.budget_s:.0f} s budget)")
    console.print(f"report: {report}")
    return state.run_dir


def _profile(args: OptimizeArgs, target: Any, state: RunState, batches: tuple[int, ...],
             deadline: float) -> None:
    from .profiler import profile_batches
    from .profiler.report import summary, write_outputs

    state.set_phase("profiling")
    reg = env.open_registry(args.registry)
    if not reg.root.is_dir():  # a new registry: every op's baseline is the reference
        reg.prepare_write()
    registry = reg.root
    profiles = profile_batches(target, batches, layers=args.layers, kernels="tuned",
                               proxy=args.proxy, backend=args.profile_backend,
                               registry=registry, deadline=deadline)
    by_batch = {}
    for k, prof in enumerate(profiles):
        # profile_before.json is the first batch's (autoopt profile --compare reads it).
        write_outputs(prof, state.run_dir, "profile_before" if k == 0 else
                      f"profile_before_b{prof.batch}")
        say(f"batch {prof.batch}: " + "; ".join(summary(prof)[:2]))
        by_batch[str(prof.batch)] = {"rows": prof.to_dict()["rows"], "step_us": prof.step_us,
                                     "floor_us": prof.floor_us, "context": prof.context,
                                     "graph_step_us": prof.graph_step_us}
    first = profiles[0]
    state.update(profile={"kernels": "tuned", "rows": by_batch[str(first.batch)]["rows"],
                          "by_batch": by_batch, "step_us": first.step_us, "gpu": first.gpu,
                          "batch": first.batch, "layers": first.layers,
                          "backend": first.backend, "meaningful": first.rates.meaningful})


def rank_rows(profile: dict) -> list[dict]:
    """Op-contract rows summed over the profiled batch sizes, largest time above floor first."""
    from model.ops import CONTRACTS

    by_batch = profile.get("by_batch") or {str(profile.get("batch")): {"rows": profile["rows"]}}
    ops: dict[str, dict] = {}
    for b, entry in by_batch.items():
        for r in entry["rows"]:
            if r["op"] not in CONTRACTS:
                continue
            o = ops.setdefault(r["op"], {"op": r["op"], "time_us": 0.0, "floor_us": 0.0,
                                         "gap_us": 0.0, "by_batch": {}})
            gap = r.get("gap_us") if r.get("gap_us") is not None else r["time_us"]
            o["time_us"] += r["time_us"]
            o["floor_us"] += r.get("floor_us") or 0.0
            o["gap_us"] += gap
            o["by_batch"][b] = {"time_us": r["time_us"], "floor_us": r.get("floor_us"),
                                "gap_us": gap}
    return sorted(ops.values(), key=lambda o: -o["gap_us"])


def _rank(args: OptimizeArgs, agent: Any, state: RunState) -> None:
    from model.ops import CONTRACTS

    wanted = set(args.ops) if args.ops else None
    ops = []
    rows = rank_rows(state.data["profile"])
    ranked = {r["op"] for r in rows}
    for r in rows:
        if wanted is not None and r["op"] not in wanted:
            continue
        status = "pending" if agent.supports(r["op"]) else "skipped"
        ops.append({**r, "status": status,
                    "note": "" if status == "pending" else f"no {agent.name} proposals for it"})
    # A part of a composite op (attn_output_gate inside gated_o_proj) has no range of its own in
    # the profile: asked for by name, it is optimized on its own contract, after the ranked ops.
    for r in rows:
        for part in CONTRACTS[r["op"]].parts if r["op"] in CONTRACTS else ():
            if wanted is not None and part in wanted and part not in ranked:
                ranked.add(part)
                status = "pending" if agent.supports(part) else "skipped"
                ops.append({"op": part, "time_us": 0.0, "floor_us": 0.0, "gap_us": 0.0,
                            "by_batch": {}, "status": status,
                            "note": f"runs inside {r['op']} (its time is counted there)"})
    state.set_ops(ops)
    listed = ", ".join(o["op"] + ("" if o["status"] == "pending" else "*") for o in ops)
    say(f"ops by time above floor (summed over batch sizes): {listed}  (* skipped: the "
        f"{agent.name} agent has nothing for it)")


def op_deadline(now: float, end: float, remaining: int, min_op_s: float,
                min_start_s: float = 0.0, slots: int = 1) -> float | None:
    """The next op's deadline when `remaining` ops (this one included) share what is left,
    `slots` at a time: an equal share per round, at least `min_op_s` (so that the ops started
    can finish a proposal rather than every op time out), never past `end`; None: less than
    `min_start_s` is left."""
    if end - now < max(min_start_s, 1e-9) or remaining < 1:
        return None
    rounds = -(-remaining // max(1, slots))
    return min(end, now + max((end - now) / rounds, min_op_s))


JUDGE_MARGIN = 1.25  # an op's last verification time, times this, plus its timing
# One token bucket's timing (a worker's inputs, compiles, warmup and timed calls), the
# candidate's and the baseline's each: on an H200 the attention baseline's eight buckets at a
# 100k-token context took more than 30 s.
TIMING_PER_BUCKET_S = 4.0
# ... and at least this share of the op's verification a bucket: both are made of the same
# per-shape compiles and inputs, so an op slow to verify is slow to time. On an H100 a MoE
# candidate verified in ~260 s, and its and the baseline's eight buckets did not finish in 100 s.
TIMING_PER_BUCKET_OF_JUDGE = 0.04


def timing_seconds(buckets: int, judged_s: float | None = None) -> float:
    """Seconds the candidate's and the baseline's timings at `buckets` token buckets take, for
    an op whose verification takes `judged_s` (None: not known)."""
    per = max(TIMING_PER_BUCKET_S, (judged_s or 0.0) * TIMING_PER_BUCKET_OF_JUDGE)
    return 2 * max(1, buckets) * per


def judge_seconds(registry: Any, op: str, arch: str | None) -> float | None:
    """The longest verification (seconds) recorded for a variant of `op` on `arch`: what one
    candidate's may take on this machine; None: none recorded. The longest, not a typical one:
    variants differ (on an H200 the QKV projection's took 58-176 s, the MoE's 74-228 s), a
    template's program is one of them, and one arch spans GPUs of different speeds (sm_90: the
    H200 and the H100). An estimate too short starts an op whose candidate is then verified
    and cut off before it is timed, which spends the op's whole session for nothing."""
    if not arch:
        return None
    times = []
    for name in registry.variants(op):
        try:
            rec = registry.read_record(op, name)
        except Exception:  # noqa: BLE001 - an unreadable record estimates nothing
            continue
        for v in (rec.verification.get(arch, ()) if rec else ()):
            t = (v.report or {}).get("elapsed_s")
            if isinstance(t, int | float) and t > 0:
                times.append(float(t))
    return max(times) if times else None


def fit_deadline(need_s: float | None, now: float, deadline: float, end: float
                 ) -> tuple[float | None, str]:
    """(the op's deadline, why it is not started): an op whose one evaluation needs more than
    its share gets what it needs from the rest of the sessions' time if that is left, and is
    not started otherwise (it would only be cut off: its verification unjudged)."""
    if need_s is None or deadline - now >= need_s:
        return deadline, ""
    if end - now >= need_s:
        return now + need_s, ""
    return None, (f"one evaluation needs ~{need_s:.0f} s here (its last recorded verification "
                  f"on this arch, with timing) and {max(0.0, end - now):.0f} s were left")


def _sessions(args: OptimizeArgs, agent: Any, ctx: RunContext, state: RunState,
              console: Console, end: float, minimums: tuple[float, float] = (0.0, 0.0),
              clock: Any = time.monotonic) -> None:
    from .farm import open_farm

    state.set_phase("optimizing")
    ops = state.pending_ops()
    spec = farm_spec(args, ctx)
    ledger = Ledger(state.data.get("costs"))
    with open_farm(spec) as farm:
        slots = max(1, min(len(farm.workers), len(ops)))
        say(f"{len(ops)} op(s), {max(0.0, end - clock()):.0f} s for the sessions, "
            f"{args.sessions} session(s) per op, {slots} op(s) at a time; evaluation on "
            f"{spec.kind} farm, {len(farm.workers)} worker(s): {', '.join(farm.workers)}")
        todo: queue.Queue = queue.Queue()
        for op in ops:
            todo.put(op)
        left = [len(ops)]
        lock = threading.Lock()

        def serve() -> None:
            while not ctx.stopping.is_set():
                try:
                    op = todo.get_nowait()
                except queue.Empty:
                    return
                with lock:
                    now = clock()
                    deadline = op_deadline(now, end, left[0], *minimums, slots=slots)
                    left[0] -= 1
                    why, need = "", None
                    if deadline is not None and ctx.meaningful:
                        judged = judge_seconds(ctx.registry, op, ctx.arch)
                        buckets = len(served_batches(ctx.target))
                        need = (judged * JUDGE_MARGIN + timing_seconds(buckets, judged)
                                if judged else None)
                        deadline, why = fit_deadline(need, now, deadline, end)
                if deadline is None:
                    why = why or "the budget was spent"
                    state.update_op(op, status="not started", note=why)
                    say(f"{op}: not started, {max(0.0, end - now):.0f} s left of the sessions' "
                        f"time" + (f": {why}" if why != "the budget was spent" else ""))
                    continue
                try:
                    _one_op(args, agent, ctx, state, op, deadline, console, end, farm, ledger,
                            eval_s=need or 0.0)
                except Exception as e:  # noqa: BLE001 - one op's failure must not end the run
                    if slots == 1:
                        raise
                    if ctx.stopping.is_set():
                        return  # the op stays running: --resume continues it
                    state.update_op(op, status="error", stop_reason=f"{type(e).__name__}: {e}")
                    say(f"{op}: failed: {type(e).__name__}: {e}")

        try:
            if slots == 1:
                serve()
            else:
                threads = [threading.Thread(target=serve, name=f"autoopt-op-{k}")
                           for k in range(slots)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
        except BaseException:
            ctx.stopping.set()  # before the farm closes: what fails after it is not judged
            raise
        for line in getattr(farm, "lost", []):
            ledger.worker_lost(line)
    state.update(costs=ledger.to_json())
    say(ledger.line())


def _one_op(args: OptimizeArgs, agent: Any, ctx: RunContext, state: RunState, op: str,
            deadline: float, console: Console, end: float | None = None, farm: Any = None,
            ledger: Ledger | None = None, eval_s: float = 0.0) -> None:
    """One op's sessions until `deadline`; `eval_s`: what one candidate's evaluation is expected
    to take here (a template's tuning leaves it before the deadline)."""
    device = "cuda" if ctx.meaningful else "cpu"
    task = build_task(ctx, state, op, device)
    state.update_op(op, status="running", device=device, baseline=task.current_name)
    ledger = ledger or Ledger()

    def record(op_name: str, attempt: Any, proposal: dict) -> None:
        state.record_attempt(op_name, attempt, proposal)
        state.update(costs=ledger.to_json())
        say(f"  {op_name} #{attempt.index} {attempt.candidate}: {attempt.verdict}"
            + (f" ({attempt.reasons[0][:120]})" if attempt.reasons else "")
            + (f" -> {attempt.outcome}" if attempt.outcome else ""))
        say(f"  {ledger.line()}")

    evaluator = HarnessEvaluator(ctx, task, device, task.shapes, record, deadline=deadline,
                                 hard_deadline=end, farm=farm, ledger=ledger)
    evaluator.resume_pending()  # what an interrupted run proposed and never judged, first
    n = args.sessions
    limits = Limits(max_candidates=args.max_candidates, deadline=deadline,
                    op_candidates=args.max_candidates * n, eval_s=eval_s)
    say(f"{op}: {n} {agent.name} session(s) until {deadline - time.monotonic():.0f} s from now, "
        f"baseline {task.current_name}, {len(task.attempts)} earlier attempt(s), "
        f"{len(task.shapes)} token bucket(s) {[s['T'] for s in task.shapes]}")
    results: list[Any] = [None] * n

    def one(k: int) -> None:
        where = ctx.run_dir / "ops" / op / (f"s{k}" if n > 1 else "")
        context = SessionContext(index=k, count=n, seed=k, name=f"{op}/s{k}", ledger=ledger)
        try:
            results[k] = run_session(agent, task, evaluator, where, limits, context=context)
        except Exception as e:  # noqa: BLE001 - one session's failure must not end the run
            results[k] = e
            say(f"{op}/s{k}: session failed: {type(e).__name__}: {e}")

    if n == 1:
        one(0)
    else:
        threads = [threading.Thread(target=one, args=(k,), name=f"autoopt-{op}-s{k}")
                   for k in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if ctx.stopping.is_set():
        return  # stopped mid-op: it stays running, and --resume continues it
    _finish_op(state, op, results, ledger)


def _finish_op(state: RunState, op: str, results: list[Any], ledger: Ledger) -> None:
    failed = [r for r in results if isinstance(r, BaseException)]
    sessions = [{"session": k, "stop_reason": r.stop_reason, "attempts": len(r.attempts),
                 **{key: v for key, v in r.summary.items() if key != "stop_reason"}}
                for k, r in enumerate(results) if not isinstance(r, BaseException)]
    if failed and not sessions:
        e = failed[0]
        state.update_op(op, status="error", stop_reason=f"{type(e).__name__}: {e}")
        say(f"{op}: session failed: {type(e).__name__}: {e}")
        return
    stop = "; ".join(sorted({s["stop_reason"] for s in sessions}))
    state.update_op(op, status="done", stop_reason=stop,
                    session=sessions[0] if len(sessions) == 1 else {"sessions": sessions})
    state.update(costs=ledger.to_json())
    say(f"{op}: done ({stop})")
