"""Where autoopt finds and writes its data: a checkout vs an installed wheel, user targets."""

from __future__ import annotations

from pathlib import Path

import pytest

from autoopt import env
from autoopt.targets import TargetError, list_targets, load_target
from model.registry import Registry, paths

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for name in ("AUTOOPT_REGISTRY", "AUTOOPT_RUNS_DIR", "AUTOOPT_TASKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    return tmp_path / "data" / "autoopt"


def test_a_checkout_uses_its_own_kernels_runs_and_tasks(clean_env):
    assert paths.checkout_root() == REPO
    assert env.registry_dir() == REPO / "kernels" == paths.shipped_root()
    assert env.registry_seed() is None and env.runs_dir() == REPO / "runs"
    assert env.tasks_dirs() == [clean_env / "tasks", REPO / "tasks"]


def test_installed_the_user_registry_is_seeded_from_the_shipped_one(clean_env, monkeypatch):
    monkeypatch.setattr(paths, "checkout_root", lambda: None)
    assert paths.shipped_root() == paths.PACKAGE_DATA
    assert env.registry_dir() == clean_env / "registry"
    assert env.registry_seed() == paths.PACKAGE_DATA
    assert env.runs_dir() == clean_env / "runs"
    assert env.shipped_tasks_dir() == Path(env.__file__).parent / "_shipped" / "tasks"
    reg = env.open_registry()
    assert reg.root == paths.PACKAGE_DATA and not reg.read_only  # reads the seed, writes home
    assert Registry(paths.PACKAGE_DATA).read_only  # the installed copy itself never is written


def test_explicit_registry_wins(clean_env, monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOOPT_REGISTRY", str(tmp_path / "mine"))
    assert env.registry_dir() == tmp_path / "mine" and env.registry_seed() is None
    assert env.open_registry(tmp_path / "other").root == tmp_path / "other"


def test_user_targets_come_first_and_missing_ones_say_where_they_looked(clean_env, tmp_path):
    user = clean_env / "tasks"
    user.mkdir(parents=True)
    text = (REPO / "tasks" / "cpu-tiny.toml").read_text()
    (user / "my-cpu.toml").write_text(text.replace('name = "cpu-tiny"', 'name = "my-cpu"'))
    assert "my-cpu" in list_targets() and "h200-tp8-decode" in list_targets()
    assert load_target("my-cpu").source == user / "my-cpu.toml"
    with pytest.raises(TargetError, match=f"looked for nope.toml in {user}, {REPO / 'tasks'}"):
        load_target("nope")
    with pytest.raises(TargetError, match="looked for"):
        load_target(tmp_path / "missing.toml")
    with pytest.raises(TargetError, match=f"no targets.*looked in {tmp_path / 'empty'}"):
        list_targets(tmp_path / "empty")
