"""benchmarks/gpu_wheels.py: what a GPU machine without network lacks, from the installed needs."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
from types import SimpleNamespace

from autoopt import env


def _script():
    path = env.REPO_ROOT / "benchmarks" / "gpu_wheels.py"
    spec = importlib.util.spec_from_file_location("gpu_wheels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FAKE = {  # name -> (version, requires)
    "autoopt": ("0.1.0", ["torch>=2.9", "fastapi>=0.115", "optuna>=4",
                          'nsight-python>=0.9; extra == "profile"', 'ray==2.60; extra == "farm"']),
    "torch": ("2.13.0", ["filelock"]),
    "filelock": ("3.0", []),
    "fastapi": ("0.165.0", ["starlette>=1", "Pydantic>=2"]),
    "starlette": ("1.10.0", ["anyio"]),
    "pydantic": ("2.14.4", ["pydantic_core==2.50.5", 'tomli; python_version < "3.0"']),
    "pydantic-core": ("2.50.5", []),
    "anyio": ("4.0", []),
    "optuna": ("5.1.0", ["SQLAlchemy>=1.4", "colorlog"]),
    "sqlalchemy": ("2.1.9", []),
    "colorlog": ("6.12.0", []),
    "nsight-python": ("0.9.6", ["ncu-report", "numpy"]),
    "numpy": ("2.0", []),
}


def _dist(name):
    key = name.lower().replace("_", "-")
    if key not in FAKE:
        raise md.PackageNotFoundError(name)
    version, requires = FAKE[key]
    return SimpleNamespace(metadata={"Name": key}, version=version, requires=requires)


def test_have_lists_in_every_form_pip_prints():
    s = _script()
    have = s.read_have("Package    Version\n---------- -------\ntorch 2.11.0\nnumpy==2.5.2\n"
                       "Typing_Extensions\n# comment\nfoo @ file:///x\n\n")
    assert have == {"torch", "numpy", "typing-extensions", "foo"}


def test_needs_follow_dependencies_and_extras_and_skip_what_the_machine_has():
    s = _script()
    want, missing = s.needs("autoopt", (), {"torch", "anyio", "numpy"}, dist=_dist)
    assert want == ["colorlog==6.12.0", "fastapi==0.165.0", "optuna==5.1.0",
                    "pydantic-core==2.50.5", "pydantic==2.14.4", "sqlalchemy==2.1.9",
                    "starlette==1.10.0"]  # not autoopt itself, not the machine's, no markers
    assert missing == []
    want, missing = s.needs("autoopt", ("profile",), {"torch", "anyio", "numpy"}, dist=_dist)
    assert "nsight-python==0.9.6" in want and missing == ["ncu-report"]
    assert not any(w.startswith("ray") for w in want)  # the farm extra was not asked for
