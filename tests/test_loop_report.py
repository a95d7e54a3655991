"""The run report's reference-vs-tuned section (issue 6) without an agent: the fallbacks."""

from __future__ import annotations

import pytest

from autoopt.profiler import profile_step
from autoopt.profiler.report import write_outputs
from autoopt.report import reference_section
from autoopt.runstate import RunState


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    """Two real cpu-tiny profiles (1 layer, reference kernels: fast)."""
    out = tmp_path_factory.mktemp("profiles")
    for stem in ("profile_before", "profile_reference"):
        write_outputs(profile_step("cpu-tiny", layers=1, kernels="reference", backend="torch"),
                      out, stem)
    return out


def _state(tmp_path, profiles, reference: bool) -> RunState:
    st = RunState.create(tmp_path / "run", {"agent": "template"}, "cpu-tiny")
    for stem in ("profile_before",) + (("profile_reference",) if reference else ()):
        (st.run_dir / f"{stem}.json").write_bytes((profiles / f"{stem}.json").read_bytes())
    st.update(profile={"kernels": "tuned"}, e2e={"ran": False, "why": "nothing registered"},
              **({"profile_reference": "profile_reference.json"} if reference else {}))
    return st


def test_nothing_registered_compares_the_reference_with_the_before_profile(tmp_path, profiles):
    lines, plot = reference_section(_state(tmp_path, profiles, reference=True))
    text = "\n".join(lines)
    assert ("## Reference vs tuned (autoopt profile --compare profile_reference.json "
            "profile_before.json)") in text
    assert "nothing was registered" in text and "Whole step: reference" in text
    assert plot is not None and plot.stat().st_size > 1000


def test_a_missing_reference_profile_is_said_not_hidden(tmp_path, profiles):
    lines, plot = reference_section(_state(tmp_path, profiles, reference=False))
    assert plot is None and "not available: no reference profile" in "\n".join(lines)
