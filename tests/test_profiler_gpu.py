"""The profiler on a real GPU (run on the GPU machine; skipped on CPU).

A short proxy of h200-tp8-decode (4 layers: 3 dense + 1 MoE with full attention) on whatever
CUDA GPU is present.
"""

from __future__ import annotations

import pytest

from autoopt.profiler import profile_step
from autoopt.profiler.attribution import IDLE, OTHER
from autoopt.profiler.nsight import find_ncu
from autoopt.targets import load_target

pytestmark = pytest.mark.gpu
OPS = {"rmsnorm", "norm_residual_norm", "qkv_gate_proj", "qk_norm_rope", "qk_norm_ssmax",
       "attention", "attn_output_gate", "router", "moe_experts", "swiglu", "logit_softcap"}


@pytest.mark.parametrize("batch", [1, 17])
def test_torch_backend_on_gpu(batch):
    p = profile_step(load_target("h200-tp8-decode"), batch, layers=4, backend="torch",
                     proxy=True, context=8192)
    assert p.backend == "torch" and p.gpu != "cpu"
    assert abs(sum(r.share for r in p.rows) - 100) <= 0.5
    assert OPS <= {r.op for r in p.rows if r.kernels > 0}
    # Almost all kernel time sits inside a named range.
    other = sum(r.time_us for r in p.rows if r.op == OTHER)
    assert other < 0.05 * p.kernel_us
    assert p.row(IDLE).time_us >= 0 and p.rates.bandwidth_bytes_s > 1e12
    assert p.graph_step_us is None and "not capturable" in p.checks["graph"]


@pytest.mark.skipif(find_ncu() is None, reason="needs Nsight Compute (ncu)")
def test_ncu_backend_on_gpu():
    p = profile_step(load_target("h200-tp8-decode"), 1, layers=4, backend="ncu", proxy=True,
                     context=8192)
    assert p.backend == "ncu", p.backend_note
    assert all(r.bytes_source == "ncu" for r in p.ops() if r.kernels)
    assert OPS <= {r.op for r in p.rows if r.kernels > 0}
    # The same kernels timed by ncu (serialized, one at a time) and by CUPTI: ncu adds a little
    # to each of thousands of short kernels, so allow 1.5x; the GPU run reports the real ratio.
    assert 0.7 < p.checks["ncu_vs_torch_profiler_kernel_time"] < 1.5
