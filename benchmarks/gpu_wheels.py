"""Wheels for a GPU machine without network access: what autoopt needs that the machine lacks.

    python benchmarks/gpu_wheels.py --have HAVE.txt [--extra profile] --out .whl     (network)
    python benchmarks/gpu_wheels.py --have HAVE.txt --list                           (no network)

HAVE.txt names the distributions the GPU machine already has, one per line (`pip freeze` or
`pip list` output, or bare names; versions are ignored). The needs are read from this
environment's installed autoopt (and the extras asked for), followed through every dependency,
with their installed versions, so run it from the environment the project is installed in. The
wheels are for CPython 3.12 on manylinux x86_64, one version each, no dependencies fetched by pip
itself (`pip download --no-deps`): `benchmarks/gpu_suite.sh` installs `.whl/*.whl` on the machine
with `--no-deps` into a scratch site directory. A distribution that is not installed here is
reported, not guessed.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_28_x86_64", "manylinux_2_34_x86_64",
             "manylinux_2_35_x86_64", "manylinux1_x86_64", "any")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# Distributions that come with a tool the GPU machine already has, not from PyPI: nsight-python's
# `ncu-report` is the module inside Nsight Compute's own install (autoopt.profiler.nsight finds it
# there), and PyPI has no wheel of it for the machine's Python.
WITH_THE_MACHINE = {"ncu-report"}


def read_have(text: str) -> set[str]:
    """Distribution names from `pip freeze`, `pip list` or one name per line."""
    out = set()
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "Package", "---")):
            continue
        out.add(norm(re.split(r"[=<>~ @\[]", line, maxsplit=1)[0]))
    return out


def needs(root: str, extras: tuple[str, ...], have: set[str],
          dist=md.distribution) -> tuple[list[str], list[str]]:
    """(name==version of every installed dependency of `root` the machine lacks, names of
    dependencies not installed here). `root` itself is never listed: it travels as source."""
    seen: set[str] = set()
    want: list[str] = []
    missing: list[str] = []

    def walk(name: str, with_extras: tuple[str, ...]) -> None:
        key = norm(name)
        if key in seen or (key in have and key != norm(root)):
            return  # what the machine has brings its own dependencies
        seen.add(key)
        try:
            d = dist(name)
        except md.PackageNotFoundError:
            missing.append(name)
            return
        if key != norm(root):
            want.append(f"{d.metadata['Name']}=={d.version}")
        for spec in d.requires or []:
            req = Requirement(spec)
            env = [{"extra": e} for e in (with_extras or ("",))]
            if req.marker is not None and not any(req.marker.evaluate(e) for e in env):
                continue
            walk(req.name, tuple(req.extras))

    walk(root, extras)
    return sorted(want, key=str.lower), sorted(missing, key=str.lower)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--have", type=Path, required=True,
                   help="Distributions the GPU machine has (pip freeze or one name a line).")
    p.add_argument("--extra", action="append", default=[],
                   help="autoopt extras to include (e.g. profile, farm); repeatable.")
    p.add_argument("--out", type=Path, default=Path(".whl"))
    p.add_argument("--python", default="3.12")
    p.add_argument("--list", action="store_true", help="Print what is needed; download nothing.")
    a = p.parse_args(argv)
    have = read_have(a.have.read_text()) | WITH_THE_MACHINE
    want, missing = needs("autoopt", tuple(a.extra), have)
    for name in missing:
        print(f"not installed here, so not followed: {name}", file=sys.stderr)
    print("\n".join(want))
    if a.list or not want:
        return 0
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", a.python, "--implementation", "cp", "-d", str(a.out)]
    for plat in PLATFORMS:
        cmd += ["--platform", plat]
    return subprocess.run(cmd + want).returncode


if __name__ == "__main__":
    sys.exit(main())
