"""`--attention-backend` on top of the registry, and the FlashInfer variant's host-side planning.

On the CPU: names map onto the attention op's variants (the lock, the reference, a recorded
variant) and refusals say why; the flag reaches the runner from the CLI. FlashInfer's planning
(the contract's per-token description turned into CSR page lists, kv ranges ending at each
chunk's last query, windows) runs through a stand-in for its two wrappers that computes their
documented semantics with the reference's eager math.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from autoopt.cli import app
from model.demo import write_demo_checkpoint
from model.ops import OpTable, contract
from model.ops.attention import eager_attention
from model.registry import Registry
from model.serve import attention_backends as ab
from model.serve.engine import EngineConfig, LLMEngine

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo"), "tiny", seed=5)


def test_names_map_onto_the_registry_op() -> None:
    ops = OpTable()
    same, note = ab.select("auto", ops, CPU, torch.bfloat16)
    assert same is ops and "the lock" in note
    ref, _ = ab.select("torch", ops, CPU, torch.float32)
    assert ref.impl("attention") is contract("attention").reference
    tri, note = ab.select("triton", ops, CPU, torch.bfloat16)
    assert "triton_v1" in tri.sources["attention"] and "triton_v1" in note
    assert tri.impl("rmsnorm") is ops.impl("rmsnorm")  # only the attention op changes


@pytest.mark.parametrize("name,dtype,why", [
    ("flashinfer", torch.bfloat16, "library variants run on GPUs only"),
    ("triton", torch.float32, "BF16 contract"),
    ("agent_0999", torch.bfloat16, "has no attention/agent_0999.py"),
])
def test_refusals_say_why(name, dtype, why) -> None:
    with pytest.raises(ValueError, match=f"cannot serve here: .*{why}.*--attention-backend auto"):
        ab.select(name, OpTable(), CPU, dtype)


def test_bad_names_are_refused_early() -> None:
    with pytest.raises(ValueError, match="is not one of"):
        EngineConfig(attention_backend="flash attention")
    assert EngineConfig(attention_backend="agent_0007").attention_backend == "agent_0007"


def test_cpu_engine_uses_the_lock(demo: Path) -> None:
    eng = LLMEngine(EngineConfig(model=str(demo), device="cpu", dtype="float32",
                                 kernels="reference", max_num_seqs=2, max_model_len=64,
                                 max_num_batched_tokens=32, kv_cache_bytes=4 * 2**20))
    assert eng.runner.attention_backend == "auto"
    assert "attention: reference (the lock)" in eng.startup_report


def test_generate_flag_reaches_the_runner(demo: Path) -> None:
    base = ["generate", "--model", str(demo), "--prompt-ids", "9,10,11", "--max-tokens", "2",
            "--dtype", "float32", "--kernels", "reference", "--device", "cpu", "--json"]
    result = CliRunner().invoke(app, base + ["--attention-backend", "torch"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(app, base + ["--attention-backend", "flashinfer"])
    assert result.exit_code != 0 and "cannot serve here" in " ".join(result.output.split())


# ---- FlashInfer's planning, through a stand-in ---------------------------------------------
class _FakeWrapper:
    """Row r's keys are the first kv_len slots of its pages; its queries are the last qo_len of
    them (causal, aligned bottom-right); key j is visible while (query position - j) <=
    window_left."""

    def __init__(self, workspace, layout, use_cuda_graph=False, use_tensor_cores=False,
                 backend="auto", **buffers) -> None:
        assert layout == "NHD" and workspace.dtype == torch.uint8

    def _plan(self, qo, indptr, indices, last, hq, hkv, d, page, **kw) -> None:
        for t in (qo, indptr, indices, last):
            assert t.dtype == torch.int32 and t.device.type == "cpu"
        assert kw["pos_encoding_mode"] == "NONE" and kw["window_left"] >= 0
        self.args = (qo.tolist(), indptr.tolist(), indices.tolist(), last.tolist(), page,
                     kw["window_left"], kw["sm_scale"])

    def run(self, q, kv):
        qo, indptr, indices, last, page, window_left, scale = self.args
        k_pages, v_pages = kv
        outs = []
        for r in range(len(last)):
            pages = torch.tensor(indices[indptr[r]:indptr[r + 1]], dtype=torch.long)
            n = (len(pages) - 1) * page + last[r]
            k, v = k_pages[pages].flatten(0, 1)[:n], v_pages[pages].flatten(0, 1)[:n]
            m = qo[r + 1] - qo[r]
            outs.append(eager_attention(q[qo[r]:qo[r + 1]], k, v, torch.arange(n - m, n),
                                        torch.arange(n), window_left + 1, scale))
        return torch.cat(outs)


class _FakeDecode(_FakeWrapper):
    def plan(self, indptr, indices, last, hq, hkv, d, page, **kw) -> None:
        self.decode = True
        self._plan(torch.arange(len(last) + 1, dtype=torch.int32), indptr, indices, last, hq,
                   hkv, d, page, **kw)


class _FakePrefill(_FakeWrapper):
    def plan(self, qo, indptr, indices, last, hq, hkv, d, page, causal=False, **kw) -> None:
        assert causal
        self._plan(qo, indptr, indices, last, hq, hkv, d, page, **kw)


FAKE = SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=_FakeDecode,
                       BatchPrefillWithPagedKVCacheWrapper=_FakePrefill)


@pytest.fixture
def flashinfer_v1(monkeypatch):
    module = Registry().load_variant("attention", "flashinfer_v1")
    monkeypatch.setitem(module._STATE, "module", FAKE)
    yield module
    for key in [k for k in module._STATE if k != "module"]:
        module._STATE.pop(key)


@pytest.mark.parametrize("shape", [
    {"T": 4, "seqs": 0, "S": 30, "W": 0, "page": 4},  # decode rows
    {"T": 3, "seqs": 0, "S": 21, "W": 5, "page": 5},  # decode rows, window pages from kv_base
    {"T": 11, "seqs": 3, "S": 40, "W": 6, "page": 4},  # prefill chunks
    {"T": 6, "seqs": 1, "S": 6, "W": 0, "page": 1},  # one whole prompt, pages of one slot
])
def test_flashinfer_planning_matches_the_reference(flashinfer_v1, shape) -> None:
    c = contract("attention")
    args = c.make_inputs({**shape, "Hq": 4, "Hkv": 2, "D": 16}, 5)
    q, kc, vc, table, base, q_seq, q_pos, window, scale = (
        a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    got = flashinfer_v1.plan(tuple(q.shape), kc, vc, table, base, q_seq, q_pos, window,
                             scale)(q)
    want = c.reference(q, kc, vc, table, base, q_seq, q_pos, window, scale)
    # The same FP32 attention on the same keys: equal up to summation order.
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_flashinfer_rows_and_refusals(flashinfer_v1) -> None:
    table = torch.tensor([[5, 3, 9, 0], [7, 0, 0, 0], [2, 4, 0, 0]])
    base, q_seq = torch.tensor([0, 0, 16]), torch.tensor([0, 1, 2, 2])
    q_pos = torch.tensor([32, 0, 30, 31])
    qo, indptr, indices, last, longest = flashinfer_v1.rows(table, base, q_seq, q_pos, 16)
    assert (qo, indptr, indices, last, longest) == ([0, 1, 2, 4], [0, 3, 4, 5], [5, 3, 9, 7, 2],
                                                    [1, 1, 16], 33)
    with pytest.raises(ValueError, match="not consecutive"):
        flashinfer_v1.rows(table, base, q_seq, torch.tensor([32, 0, 30, 29]), 16)
    with pytest.raises(ValueError, match="needs 5 pages"):
        flashinfer_v1.rows(table, base, q_seq, torch.tensor([70, 0, 30, 31]), 16)
    q = torch.zeros(1, 4, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="CUDA devices only"):
        flashinfer_v1.run(q, torch.zeros(2, 4, 2, 16, dtype=torch.bfloat16), None, None, None,
                          None, None, 0, 0.25)
