"""benchmarks/ncu_kernels.py (Nsight Compute on one op's kernels; plain reads by size) on CPU."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "ncu_kernels.py"


def _script():
    spec = importlib.util.spec_from_file_location("ncu_kernels_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("n,chunk", [(1, 16384), (100_003, 16384), (65536, 65536)])
def test_the_read_kernel_sums_every_element_once(n, chunk):
    # The timed read must read every byte once: its partial sums add up to the whole sum, in
    # the interpreter (ragged last chunk, one element, one exact chunk).
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    code = (f"import importlib.util, torch\n"
            f"s = importlib.util.spec_from_file_location('m', {str(SCRIPT)!r})\n"
            f"m = importlib.util.module_from_spec(s); s.loader.exec_module(m)\n"
            f"g = torch.Generator().manual_seed({n})\n"
            f"x = torch.randint(-4, 5, ({n},), generator=g).to(torch.bfloat16)\n"
            f"out = torch.full((-(-{n} // {chunk}),), float('nan'))\n"
            f"m.triton_read(x, out, {chunk})\n"
            f"assert out.sum().item() == x.float().sum().item(), (out, x.float().sum())\n"
            f"print('ok')\n")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600, cwd=SCRIPT.parents[1])
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]


@pytest.mark.parametrize("op,t", [("moe_experts", 2), ("router", 3)])
def test_inputs_rotate_and_the_variant_runs_on_them(op, t, monkeypatch):
    # Several input sets (warm-up on the others leaves the profiled call's weights out of L2),
    # at a TP8 rank's widths (the MoE's here shrunk: its real ones are 10 GB of weights).
    import benchmarks.moe_gpu as moe_gpu

    monkeypatch.setattr(moe_gpu, "RANK", {"H": 64, "E": 16, "I": 32, "k": 8})
    mod = _script()
    fn, sets = mod.op_call(op, "triton_v1", t, "cpu")
    assert len(sets) >= 4
    if op == "router":
        h, w, bias = sets[0][:3]
        assert h.shape == (t, 5120) and w.shape == (256, 5120) and bias.shape == (256,)
    else:
        x, gu, dn, w, ids = sets[0][:5]
        assert x.shape == (t, 64) and gu.shape == (16, 64, 64) and ids.shape == (t, 8)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert fn(*sets[0]).shape == x.shape
    assert not torch.equal(sets[0][1], sets[1][1])


def test_without_a_gpu_it_says_so(tmp_path, capsys, monkeypatch):
    mod = _script()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert mod.main(["--out", str(tmp_path), "--reads"]) == 0
    assert "no GPU here" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        mod.op_call("rmsnorm", "triton_v1", 1, "cpu")
