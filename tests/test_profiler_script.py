"""benchmarks/gpu_profile.py --dry-run: the lead's H200 profiling run, on the CPU with cpu-tiny."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from autoopt import env
from autoopt.profiler.attribution import Profile


def _script():
    path = env.REPO_ROOT / "benchmarks" / "gpu_profile.py"
    spec = importlib.util.spec_from_file_location("gpu_profile", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_writes_few_flat_files(tmp_path: Path):
    out = tmp_path / "out"
    assert _script().main(["--dry-run", "--out", str(out)]) == 0
    files = sorted(p.name for p in out.iterdir())
    assert all(p.is_file() for p in out.iterdir()) and len(files) <= 8
    assert {"summary.txt", "nsight.json", "decode-b1.json", "decode-b1.png"} <= set(files)
    full = Profile.load(out / "decode-b3.json")
    assert full.batch == 3 and abs(sum(r.share for r in full.rows) - 100) <= 0.5
    nsight = json.loads((out / "nsight.json").read_text())
    assert not nsight["errors"], nsight["errors"]
    # No GPU: the "Nsight" stage degrades to the torch.profiler backend and still profiles.
    for entry in nsight["profiles"]:
        assert Profile.from_dict(entry["profile"]).backend == "torch"
        assert entry["agreement"]["events_step_us"] > 0
    assert "total" in (out / "summary.txt").read_text()


def test_ncu_layer_budget():
    from types import SimpleNamespace

    from autoopt.profiler.attribution import OpRow

    script = _script()

    rows = (OpRow("moe_experts", 1, 2000 * 52, 1.0, 100.0),)
    p = SimpleNamespace(rows=rows, layers=52)
    # 2000 kernels a layer at 30 ms each: a minute beyond the fixed start cost is one layer,
    # clamped up to the 4 that hold every op; a huge budget is every layer.
    assert script.ncu_layers(p, script.NCU_FIXED_S + 60, 0.03) == script.MIN_LAYERS
    assert script.ncu_layers(p, 1e9, 0.03) == 52
    assert script.ncu_layers(p, script.NCU_FIXED_S + 2000 * 0.03 * 10, 0.03) == 10
