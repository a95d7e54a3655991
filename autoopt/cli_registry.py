"""`autoopt registry ...` and its alias `autoopt review ...`: one sub-app over one registry.

Registered on the app by `autoopt/cli.py` through `register`. Flags become a frozen
`RegistryArgs` (or `RecordArgs`); autoopt/registry_cmd.py does the work.
"""

from __future__ import annotations

from pathlib import Path

import typer

from .console import make_console

console = make_console()
registry_app = typer.Typer(
    help="The kernel registry: list, show and review variants with their evidence; accept, "
         "reject, record and lock them.", no_args_is_help=True)
_REGISTRY = typer.Option(None, "--registry", help="Registry DIR (default: $AUTOOPT_REGISTRY, "
                         "the checkout's kernels/, or your per-user registry).")
_OP = typer.Argument(..., help="Op name (registry key), e.g. rmsnorm.")
_VARIANT = typer.Argument(..., help="Variant name, e.g. triton_v1.")


def register(app: typer.Typer) -> None:
    app.add_typer(registry_app, name="registry")
    app.add_typer(registry_app, name="review", help="Alias of `autoopt registry`.")


def _run(command: str, **fields) -> None:
    from .registry_cmd import RegistryArgs, run_registry

    code = run_registry(command, RegistryArgs(**fields), console)
    if code:
        raise typer.Exit(code)


@registry_app.command("list")
def list_(
    registry: Path = _REGISTRY,
    op: str = typer.Option(None, "--op", help="Only this op."),
    status: str = typer.Option(None, help="Only candidate, accepted or rejected variants."),
    as_json: bool = typer.Option(False, "--json", help="Print the rows as JSON."),
) -> None:
    """Every variant: status, language, file check (exit 1 if a recorded file changed), lock,
    per-arch verdicts, best speed-up."""
    _run("list", root=registry, op=op, status=status, as_json=as_json)


@registry_app.command("show")
def show(
    op: str = _OP, variant: str = _VARIANT, registry: Path = _REGISTRY,
    arch: str = typer.Option(None, help="Diff against the variant locked for this arch."),
    as_json: bool = typer.Option(False, "--json", help="Print the record as JSON."),
) -> None:
    """Source, diff against the selection (or reference), verification, timings, configs."""
    _run("show", root=registry, op=op, variant=variant, arch=arch, as_json=as_json)


@registry_app.command("diff")
def diff(op: str = _OP, a: str = typer.Argument(..., help="First variant."),
         b: str = typer.Argument(..., help="Second variant."), registry: Path = _REGISTRY) -> None:
    """Source diff of two variants of one op, with their evidence side by side."""
    _run("diff", root=registry, op=op, variant=a, other=b)


@registry_app.command("record")
def record(
    op: str = _OP, variant: str = _VARIANT, registry: Path = _REGISTRY,
    device: str = typer.Option("auto", help="cpu, cuda or auto (cuda when present)."),
    seeds: int = typer.Option(3, help="Seeds per shape (secret: drawn for this run)."),
    tokens: str = typer.Option(None, help="Token counts of the shapes (default: the judge's)."),
    target: str = typer.Option(None, "--target", help="Time at this target's shapes."),
    bench: bool = typer.Option(True, "--bench/--no-bench", help="Also time it."),
    compile_: bool = typer.Option(True, "--compile/--no-compile",
                                  help="Also time torch.compile of the reference."),
    warmup: int = typer.Option(10, help="Warm-up calls before timing."),
    iters: int = typer.Option(50, help="Timed samples."),
    timeout: float = typer.Option(600.0, help="Seconds before a judge's child is killed."),
    agent: str = typer.Option("hand-written", help="Provenance of a variant without a record."),
) -> None:
    """Verify and time a variant file already in the registry on this machine, and write its
    record (verification for this arch, benchmark rows for this GPU). Exit 1 if rejected."""
    from model.registry import RegistryError

    from . import env
    from .registry_record import RecordArgs, record_variant

    def ints(text: str | None) -> tuple[int, ...]:
        return tuple(int(x) for x in (text or "").split(",") if x.strip())

    args = RecordArgs(op, variant, device, seeds, ints(tokens), target, bench, warmup,
                      iters, compile_, timeout, agent)
    try:
        rec, report, rows = record_variant(env.open_registry(registry), args)
    except (RegistryError, ValueError, FileNotFoundError) as exc:
        make_console(stderr=True).print(f"[red]error:[/] {exc}", highlight=False)
        raise typer.Exit(2) from None
    console.print(f"{op}/{variant}: {report.get('verdict')} on {report.get('device')}, "
                  f"{len(rows)} timing rows; record {rec.status}, verdicts "
                  f"{rec.verdicts()}", highlight=False)
    for reason in report.get("reasons") or []:
        console.print(f"  - {reason}", highlight=False)
    raise typer.Exit(0 if report.get("verdict") == "pass" else 1)


@registry_app.command("tune")
def tune(
    op: str = _OP, variant: str = _VARIANT, registry: Path = _REGISTRY,
    configs: str = typer.Option(..., "--configs", help="JSON config per token bucket, e.g. "
                                '\'{"T=1": {"BLOCK_K": 1024}, "T=4": null}\' (a sweep\'s best). '
                                "A call takes the bucket nearest its T (in log2), so the last "
                                "config also serves every T above it: a null bucket after it "
                                "hands those back to the file's defaults."),
    device: str = typer.Option("auto", help="cpu, cuda or auto (cuda when present)."),
    target: str = typer.Option(None, "--target", help="Verify and time at this target's "
                               "widths (e.g. h200-tp8-decode; default: the judge's)."),
    seeds: int = typer.Option(2, help="Seeds per shape (secret: drawn for this run)."),
    warmup: int = typer.Option(10, help="Warm-up calls before timing."),
    iters: int = typer.Option(50, help="Timed samples."),
    timeout: float = typer.Option(600.0, help="Seconds before a judge's child is killed."),
    source: Path = typer.Option(None, "--source", help="Where the configs came from (e.g. a "
                                "sweep's results.json), kept with the proposal."),
) -> None:
    """Propose tuned configs for a recorded variant on this GPU: verified with them (each call
    gets its bucket's), each bucket timed with its config beside the default; written to the
    record if it passes, where on a GPU a config slower than the default is proposed as the
    default there. Exit 1 when nothing is written."""
    import json

    from model.registry import RegistryError

    from . import env
    from .registry_record import TuneArgs, tune_variant

    try:
        table = json.loads(configs)
        if not isinstance(table, dict):
            raise ValueError("--configs must be a JSON object of bucket -> config")
        text = source.read_text()[:20000] if source else None
        rec, report, rows, what = tune_variant(env.open_registry(registry), TuneArgs(
            op, variant, table, device, seeds, target, warmup, iters, timeout, text))
    except (RegistryError, ValueError, FileNotFoundError) as exc:
        make_console(stderr=True).print(f"[red]error:[/] {exc}", highlight=False)
        raise typer.Exit(2) from None
    console.print(f"{op}/{variant}: {report.get('verdict')} on {report.get('device')}; {what}",
                  highlight=False)
    for reason in report.get("reasons") or []:
        console.print(f"  - {reason}", highlight=False)
    for r in rows:
        console.print(f"  T={r['shape'].get('T')} {r['label']:<7} {r['median_us']:9.2f} us  "
                      f"{json.dumps(r['config'], sort_keys=True)}", highlight=False)
    raise typer.Exit(0 if rec is not None else 1)


@registry_app.command("accept")
def accept(
    op: str = _OP, variant: str = _VARIANT, registry: Path = _REGISTRY,
    arch: str = typer.Option(None, help="Lock section, e.g. sm_90 (default: the one arch it "
                             "passed verification on)."),
) -> None:
    """Accept a variant: its proposed configs go to configs/, it is locked for the arch."""
    _run("accept", root=registry, op=op, variant=variant, arch=arch)


@registry_app.command("reject")
def reject(
    op: str = _OP, variant: str = _VARIANT, registry: Path = _REGISTRY,
    why: str = typer.Option(..., "--why", help="What is wrong with it (kept in the record)."),
) -> None:
    """Reject a variant with a reason (recorded; removed from the lock if locked)."""
    _run("reject", root=registry, op=op, variant=variant, reason=why)


@registry_app.command("set-status")
def set_status(
    op: str = _OP, variant: str = _VARIANT,
    status: str = typer.Argument(..., help="candidate, accepted or rejected."),
    reason: str = typer.Option("", help="Why (kept in the record)."), registry: Path = _REGISTRY,
) -> None:
    """Set a recorded variant's status without locking it (accepted moves its configs in)."""
    _run("set-status", root=registry, op=op, variant=variant, status=status, reason=reason)


@registry_app.command("lock")
def lock(
    registry: Path = _REGISTRY,
    arch: str = typer.Option(None, help="Arch section, e.g. sm_90 (default: this machine's)."),
    op: str = typer.Option(None, "--op", help="Op to select a variant for."),
    variant: str = typer.Option(None, "--variant", help="Accepted variant to lock for --op."),
    unset: bool = typer.Option(False, "--unset", help="Remove --op from the arch section."),
    lock_file: Path = typer.Option(None, "--file", help="Lock file (default: the registry's)."),
    as_json: bool = typer.Option(False, "--json", help="Print the entries as JSON."),
) -> None:
    """Show the lock and each entry's evidence (exit 1 if one would be refused), or edit it."""
    _run("lock", root=registry, arch=arch, op=op, variant=variant, unset=unset,
         lock_file=lock_file, as_json=as_json)


@registry_app.command("migrate")
def migrate(registry: Path = _REGISTRY) -> None:
    """Rewrite a registry written by an older autoopt in the current schema (evidence kept)."""
    _run("migrate", root=registry)


@registry_app.command("serve")
def serve(
    registry: Path = _REGISTRY,
    runs_dir: Path = typer.Option(None, "--runs-dir", help="Optimize runs to show (default: "
                                  "$AUTOOPT_RUNS_DIR, the checkout's runs/, or your per-user "
                                  "runs)."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on; anything but loopback "
                             "is served with a warning."),
    port: int = typer.Option(8765, help="Port (0 takes a free one)."),
) -> None:
    """Review in the browser: the registry by op, each candidate's diff beside its evidence,
    its optimize run; accept, reject and lock as the commands here do. Prints the URL with its
    access token."""
    from . import env
    from .review_web import serve as serve_web

    err = make_console(stderr=True)
    try:
        serve_web(env.open_registry(registry), runs_dir or env.runs_dir(), host, port,
                  say=lambda t: console.print(t, highlight=False, markup=False, soft_wrap=True),
                  warn=lambda t: err.print(f"[bold red]{t}[/]", highlight=False))
    except OSError as exc:
        err.print(f"[red]error:[/] {exc}", highlight=False)
        raise typer.Exit(2) from None
