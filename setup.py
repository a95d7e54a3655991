"""Build hook: the wheel carries the shipped targets and the default kernel registry.

Everything else about the package is in pyproject.toml. The repository's `kernels/` (variants,
records, configs, NOTES, the lock) and `tasks/*.toml` are data, not import packages, so a plain
wheel would leave them out. `build_py` copies them into the built packages as
`model/registry/_shipped/` (the runtime's default registry, read-only once installed) and
`autoopt/_shipped/tasks/`: names inside our own packages, so nothing collides with another
distribution's top-level `kernels` package. Editable installs skip the copy and read the
checkout's kernels/ and tasks/ in place (model/registry/paths.py, autoopt/env.py).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
SHIPPED = (("kernels", Path("model", "registry", "_shipped")),
           ("tasks", Path("autoopt", "_shipped", "tasks")))
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.tmp")


class BuildPyWithData(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for src, dst in SHIPPED:
            source, target = ROOT / src, Path(self.build_lib) / dst
            if not source.is_dir():
                raise FileNotFoundError(f"{source} is missing: the wheel must ship it (build from "
                                        "a clone or an sdist that includes it)")
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(source, target, ignore=IGNORE)


setup(cmdclass={"build_py": BuildPyWithData})
