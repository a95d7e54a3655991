"""autoopt installed from its wheel, as a new user installs it, run outside the clone.

The wheel is built from a copy of the project's files, installed (no dependencies; they come
from this environment) into a fresh virtual environment, and run from a directory outside the
clone with a fresh HOME: the shipped targets and registry are there, the shipped registry stays
untouched, and what `optimize` writes lands in the per-user data directory.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "autoopt", "model",
           "kernels", "tasks")


def _build_wheel(tmp: Path) -> Path:
    src = tmp / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "_shipped", "*.egg-info")
    for name in SOURCES:
        (shutil.copytree if (REPO / name).is_dir() else shutil.copy2)(
            REPO / name, src / name, **({"ignore": ignore} if (REPO / name).is_dir() else {}))
    # Offline where this environment can build (setuptools present); else pip's isolated build.
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", *isolation,
                    "-w", str(tmp / "dist"), "-q"], check=True, cwd=tmp)
    return next((tmp / "dist").glob("autoopt-*.whl"))


def _venv(tmp: Path, wheel: Path) -> Path:
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True)
    py = venv / "bin" / "python"
    purelib = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                   "['purelib'])"], check=True, capture_output=True,
                                  text=True).stdout.strip())
    # This environment's packages (torch, typer, ...) after the venv's own: a path line in a .pth
    # file does not run that directory's .pth files, so an editable install there stays out.
    (purelib / "zz_test_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([str(py), "-m", "pip", "install", "--no-deps", "--ignore-installed", "-q",
                    str(wheel)], check=True)
    return venv


def _tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file() and "__pycache__" not in p.parts:
            h.update(str(p.relative_to(root)).encode() + p.read_bytes())
    return h.hexdigest()


@pytest.mark.slow
def test_installed_wheel_ships_targets_and_registry_and_writes_outside_site_packages(tmp_path):
    wheel = _build_wheel(tmp_path)
    venv = _venv(tmp_path, wheel)
    away = tmp_path / "elsewhere"
    away.mkdir()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("AUTOOPT_") and k not in ("PYTHONPATH", "XDG_DATA_HOME")}
    env.update(HOME=str(tmp_path / "home"), XDG_DATA_HOME=str(tmp_path / "data"),
               PATH=f"{venv / 'bin'}:{env.get('PATH', '')}", TRITON_INTERPRET="1",
               COLUMNS="200")

    def autoopt(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([str(venv / "bin" / "autoopt"), *args], cwd=away, env=env,
                              capture_output=True, text=True, timeout=timeout)

    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import autoopt, model.registry "
                            "as r; print(autoopt.__file__); print(r.shipped_root())"], cwd=away,
                           env=env, capture_output=True, text=True, check=True).stdout.split()
    assert where[0].startswith(str(venv)), where  # the installed package, not the clone
    shipped = Path(where[1])
    assert shipped.is_relative_to(venv) and shipped.name == "_shipped"
    before = _tree_digest(shipped)

    out = autoopt("targets")
    assert out.returncode == 0, out.stderr
    for name in ("cpu-tiny", "h200-tp8-decode", "h200-tp2-decode"):
        assert name in out.stdout
    out = autoopt("registry", "lock")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "sm_90" in out.stdout and "norm_residual_norm" in out.stdout
    out = autoopt("verify", "--op", "swiglu", "--variant", "triton_v2", "--device", "cpu")
    assert out.returncode == 0, out.stdout + out.stderr
    out = autoopt("optimize", "--target", "cpu-tiny", "--agent", "template", "--ops", "swiglu",
                  "--max-candidates", "1", "--trials", "1", "--layers", "2", "--verify-seeds",
                  "1", "--bench-iters", "2", "--no-e2e", "--budget", "5m", timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    data = tmp_path / "data" / "autoopt"
    runs = list((data / "runs").glob("*-cpu-tiny"))
    assert len(runs) == 1 and (runs[0] / "report.md").is_file()
    user = data / "registry"
    assert (user / "registry.lock.toml").is_file()  # seeded from the shipped registry
    assert [p.stem for p in (user / "swiglu").glob("template_*.py")]  # the run's candidate
    assert _tree_digest(shipped) == before  # the shipped registry was not written
    out = autoopt("review", "list", "--status", "candidate", "--json")
    assert out.returncode == 0 and "template_" in out.stdout  # the user's registry is the default
