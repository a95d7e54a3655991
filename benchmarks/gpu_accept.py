"""After `benchmarks/gpu_kernels.py --write-registry` on a GPU: accept and lock each op's winner.

    python benchmarks/gpu_accept.py --arch sm_90 [--registry DIR] [--before-lock PATH]
        [--before OP=VARIANT ...]

For every op, the candidates whose record passed verification on `--arch` for the file as it is
now, and whose timing rows on that arch's GPU beat the reference (geometric mean of x reference
over the rows above 1), compete with the variant the lock selects now (its rows from the same
run): the fastest by that geometric mean is accepted (`writers.accept`, which locks it) when it
beats the current selection. A composite op without a variant of its own (gated_o_proj) is served
as its locked parts' composition: a candidate must also beat that (`x_selection`, which
`gpu_kernels.py` times beside it). Nothing is accepted on evidence from another arch or another
run's GPU. `--before-lock` first writes a lock file of the selection as it was (the lock's entries
for `--arch`, plus `--before OP=VARIANT` pins of verified candidates), for `bench model`'s "before"
kernel set. A selected variant that stays selected has its configs proposed by a tune
(`autoopt registry tune`) taken into configs/, as accepting a winner takes its own. Prints one
line per op saying what it did and why, with the accepted variant's standing against
torch.compile where its rows timed it (not a condition: the server runs the reference eagerly
where the lock has no variant, unless asked for `tuned+compile`).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.registry import Registry, RegistryError, writers  # noqa: E402
from model.registry.composite import composed_selection  # noqa: E402


def geomean_x_reference(rec, gpu: str | None, key: str = "x_reference") -> float | None:
    xs = [b.row.get(key) for b in rec.benchmarks
          if b.row.get("meaningful") and (gpu is None or b.row.get("gpu") == gpu)]
    xs = [x for x in xs if isinstance(x, (int, float)) and x > 0]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def _vs_compile(rec, gpu: str | None) -> str:
    """Its standing against torch.compile of the reference, where its rows timed that: the bar
    a server that compiles what it does not lock (`--kernels tuned+compile`) sets."""
    x = geomean_x_reference(rec, gpu, "x_compile")
    if x is None:
        return ""
    return f"; x{x:.2f} over torch.compile" + (" (slower: tuned+compile would beat it)"
                                                if x < 1.0 else "")


def write_before_lock(reg: Registry, arch: str, path: Path, pins: list[str]) -> None:
    """A lock file holding the current selection for `arch` plus `pins` (verified candidates)."""
    entries = dict(reg.read_lock().section(arch))
    for pin in pins:
        op, name = pin.split("=", 1)
        try:
            entries[op] = writers.lock_entry(reg, op, name, arch, allow_candidates=True)
        except RegistryError as e:  # no evidence on this arch: the "before" set goes without it
            print(f"before-lock: {op}={name} not pinned: {e}")
    lock = reg.read_lock(path)  # empty when absent
    for op, entry in sorted(entries.items()):
        lock = lock.with_entry(arch, op, entry)
    reg._write_lock(lock, path)
    pinned = ", ".join(f"{o}={e.variant}" for o, e in sorted(entries.items()))
    print(f"before-lock {path}: {pinned}")


def take_tuned(reg: Registry, op: str, current, arch: str) -> None:
    """The selected variant's tuned configs, proposed by `autoopt registry tune` (which proposes
    only configs verified with the file and no slower than the defaults at any bucket it timed),
    join configs/ and the lock is pinned to them. A variant kept over the candidates is otherwise
    left with its proposal waiting, and the served step runs its old configs."""
    if current is None:
        return
    rec = reg.read_record(op, current.variant)
    variant = reg.read_variant(op, current.variant)[0]
    if rec is None or not rec.proposed_configs or not rec.verified(arch, variant.sha256):
        return
    gpus = sorted({e.key.gpu for e in rec.proposed_configs.entries})
    writers.accept(reg, op, current.variant, arch,
                   reason=f"its tuned configs for {', '.join(gpus)} taken (verified with them, "
                          "no bucket slower than the defaults)")
    print(f"{op}: took {current.variant}'s tuned configs for {', '.join(gpus)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--registry", type=Path, default=None)
    p.add_argument("--gpu", default=None, help="Only timing rows of this GPU (default: any).")
    p.add_argument("--before-lock", type=Path, default=None)
    p.add_argument("--before", action="append", default=[], help="OP=VARIANT pinned in it.")
    args = p.parse_args(argv)
    reg = Registry(args.registry)
    if args.before_lock:
        write_before_lock(reg, args.arch, args.before_lock, args.before)
    selected = reg.read_lock().section(args.arch)
    for op in reg.ops():
        best: tuple[float, str] | None = None
        current = selected.get(op)
        # A composite op without a variant is served as its locked parts' composition.
        composed = composed_selection(reg, op, args.arch, args.gpu or "*", [])
        cur_x = None
        for name in reg.names(op):
            rec = reg.read_record(op, name)
            if rec is None:
                continue
            variant = reg.read_variant(op, name)[0]
            if not rec.verified(args.arch, variant.sha256):
                continue
            x = geomean_x_reference(rec, args.gpu)
            if current is not None and name == current.variant:
                cur_x = x
                continue
            if rec.status != "candidate" or x is None or x <= 1.0:
                continue
            if composed is not None:
                x_sel = geomean_x_reference(rec, args.gpu, "x_selection")
                if x_sel is None or x_sel <= 1.0:
                    print(f"{op}: {name} not accepted: x{x:.2f} over the reference, but "
                          + (f"x{x_sel:.2f} over {composed.label}" if x_sel is not None else
                             f"never timed against {composed.label}") + ", what it replaces")
                    continue
            if best is None or x > best[0]:
                best = (x, name)
        if best is None:
            now = current.variant if current else "reference"
            print(f"{op}: nothing to accept (current {now})")
            take_tuned(reg, op, current, args.arch)
            continue
        if cur_x is not None and best[0] <= cur_x:
            print(f"{op}: keep {current.variant} (x{cur_x:.2f} over the reference) over "
                  f"{best[1]} (x{best[0]:.2f})")
            take_tuned(reg, op, current, args.arch)
            continue
        vs_compile = _vs_compile(reg.read_record(op, best[1]), args.gpu)
        writers.accept(reg, op, best[1], args.arch,
                       reason=f"accepted for {args.arch} on its GPU evidence: verified there, "
                              f"x{best[0]:.2f} over the reference (geometric mean of its timing "
                              f"rows)" + (f", current {current.variant} x{cur_x:.2f}"
                                          if cur_x else "") + vs_compile)
        print(f"{op}: accepted and locked {best[1]} (x{best[0]:.2f}"
              + (f"; was {current.variant} x{cur_x:.2f})" if current else "; was the reference)")
              + vs_compile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
