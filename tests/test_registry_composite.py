"""A composite op's selection: the served composition of the lock's parts, as a timeable module.

gated_o_proj without a variant of its own runs as the locked attn_output_gate kernel, then the
library GEMM; the module `composed_selection` writes for the judge must compute exactly that
(same bits as the op table's composition) and take the part's tuned config per bucket.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from model.ops import contract
from model.registry import ConfigEntry, ConfigKey, ConfigTable, writers
from model.registry.composite import composed_selection

from .registry_support import lock_shipped, resolve

SHAPES = [{"T": t, "Hq": 3, "D": 32, "H": 48} for t in (1, 9)]


def _module(source: str, tmp_path, name="composed"):
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_composed_module_is_the_tables_composition(tmp_path):
    reg = lock_shipped(tmp_path / "kernels", "attn_output_gate", "triton_v2", "cpu")
    sel = composed_selection(reg, "gated_o_proj", "cpu", "cpu", SHAPES)
    assert sel is not None and sel.label == "composed: attn_output_gate/triton_v2 + library"
    assert sel.per_bucket == {"T=1": None, "T=9": None}  # no tuned configs: the part's default
    from autoopt.eval.screen import static_screen

    assert static_screen(sel.source, "composed.py") == []  # the judge's worker will take it
    mod = _module(sel.source, tmp_path)
    table, refused = resolve(reg)
    assert refused == [] and table.sources["attn_output_gate"].startswith("triton_v2")
    c = contract("gated_o_proj")
    for seed, shape in enumerate(SHAPES):
        args = c.make_inputs(shape, seed)
        assert torch.equal(mod.run(*args), table.gated_o_proj(*args))
        assert torch.equal(mod.run(*args), c.reference(*args))  # the gate kernel is bitwise


def test_no_composition_without_a_locked_part_or_with_the_composite_locked(tmp_path):
    reg = lock_shipped(tmp_path / "a", "rmsnorm", "triton_v2", "cpu")
    assert composed_selection(reg, "gated_o_proj", "cpu", "cpu", SHAPES) is None
    assert composed_selection(reg, "rmsnorm", "cpu", "cpu", SHAPES) is None  # not composite
    reg = lock_shipped(tmp_path / "b", "attn_output_gate", "triton_v2", "cpu")
    assert composed_selection(reg, "gated_o_proj", "sm_90", "H200", SHAPES) is None  # other arch
    lock_shipped(reg.root, "gated_o_proj", "template_splitk_v1", "cpu")
    assert composed_selection(reg, "gated_o_proj", "cpu", "cpu", SHAPES) is None


def test_a_refused_part_serves_the_reference_so_nothing_is_composed(tmp_path):
    reg = lock_shipped(tmp_path / "kernels", "attn_output_gate", "triton_v2", "cpu")
    path = reg.variant_path("attn_output_gate", "triton_v2")
    path.write_text(path.read_text() + "\n# edited after locking\n")
    assert composed_selection(reg, "gated_o_proj", "cpu", "cpu", SHAPES) is None


def test_the_parts_tuned_config_goes_with_each_bucket(tmp_path):
    reg = lock_shipped(tmp_path / "kernels", "attn_output_gate", "triton_v2", "cpu")
    small, large = {"BLOCK": 256, "num_warps": 2}, {"BLOCK": 2048, "num_warps": 8}
    table = ConfigTable([ConfigEntry(ConfigKey("cpu", (("D", 32), ("Hq", 3)), b), cfg)
                         for b, cfg in ((1, small), (8, large))])
    writers.tune(reg, "attn_output_gate", "triton_v2", table, {"by": "hand"})
    writers.accept(reg, "attn_output_gate", "triton_v2", "cpu")
    sel = composed_selection(reg, "gated_o_proj", "cpu", "cpu", SHAPES)
    assert sel.per_bucket == {"T=1": small, "T=9": large}
    mod = _module(sel.source, tmp_path)
    c = contract("gated_o_proj")
    args = c.make_inputs(SHAPES[1], 4)
    assert torch.equal(mod.run(*args, config=large), c.reference(*args))


@pytest.mark.parametrize("op", ["gated_o_proj"])
def test_every_composite_declares_a_composed_run(op):
    c = contract(op)
    assert c.parts and c.compose is not None and "def run(" in c.module.COMPOSED_RUN


def test_the_loop_times_a_fused_candidate_against_the_composition(tmp_path):
    # What the optimize loop hands its worker as the baseline of gated_o_proj when only the gate
    # is locked: the composed module with the gate's per-bucket configs, named for the report.
    from autoopt.agents.base import OptimizationTask
    from autoopt.loop_eval import HarnessEvaluator, RunContext
    from autoopt.targets import load_target

    reg = lock_shipped(tmp_path / "kernels", "attn_output_gate", "triton_v2", "cpu")
    ctx = RunContext(run_dir=tmp_path / "run", registry=reg, target=load_target("cpu-tiny"),
                     arch="cpu", gpu="cpu")
    task = OptimizationTask.build("gated_o_proj", hardware={}, shapes=SHAPES, device="cpu")
    ev = HarnessEvaluator(ctx, task, "cpu", SHAPES, lambda *a: None)
    source, per_bucket = ev.baseline_spec()
    assert source == composed_selection(reg, "gated_o_proj", "cpu", "cpu", SHAPES).source
    assert per_bucket == {"T=1": None, "T=9": None}
    assert (ev.baseline_name, ev.baseline_label) == (
        "composed", "composed: attn_output_gate/triton_v2 + library")
    # Without a locked part the bar is the reference, as for any op.
    other = HarnessEvaluator(RunContext(run_dir=tmp_path / "run2", registry=lock_shipped(
        tmp_path / "k2", "rmsnorm", "triton_v2", "cpu"), target=load_target("cpu-tiny"),
        arch="cpu", gpu="cpu"), task, "cpu", SHAPES, lambda *a: None)
    assert other.baseline_spec() == (None, {}) and other.baseline_label == "reference"
