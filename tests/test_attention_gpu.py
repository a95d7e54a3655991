"""On a CUDA GPU: the attention block's Triton variants at Beam's TP8 rank shapes against the
references, and decode through them captured in CUDA graphs (tickets reset, no host syncs)
giving what the same padded forward gives eagerly."""

from __future__ import annotations

import pytest
import torch

from autoopt.eval.numerics import ulp_diff_at
from model.config import preset
from model.demo import write_demo_checkpoint
from model.ops import OpTable, contract
from model.registry import Registry
from model.serve.engine import EngineConfig, LLMEngine, SamplingParams
from model.serve.graphs import DecodeGraphs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
BLOCK = (("qk_norm_rope", "template_rows_v2"), ("qk_norm_ssmax", "template_rows_v2"),
         ("attention", "triton_v1"), ("qkv_gate_proj", "triton_v1"))


def _ulps(got: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """Ulps at the op's scale, max(|ref|, magnitude), as the verifier counts them."""
    return ulp_diff_at(got, ref, magnitude).abs()


@pytest.mark.parametrize("context,batch,window", [(1024, 1, 0), (8192, 8, 0), (8192, 8, 512),
                                                  (3000, 33, 512), (131072, 1, 0),
                                                  (8192, 1, 512)])
@pytest.mark.parametrize("splits", [0, 1, 16, 128])
def test_triton_attention_within_the_policy(context, batch, window, splits):
    c = contract("attention")
    run = Registry().load_variant("attention", "triton_v1").run
    shape = {"T": batch, "seqs": 0, "S": context, "Hq": 6, "Hkv": 1, "D": 128, "W": window,
             "page": 16}
    args = c.make_inputs(shape, 1, "cuda")
    got, ref = run(*args, config={"SPLITS": splits, "BLOCK_N": 64}), c.reference(*args)
    near = c.numerics.near_misses["fp32_probs"](*args)
    d = _ulps(got, ref, c.numerics.magnitude(*args))
    assert int(d.max()) <= c.numerics.max_ulp
    assert float((d > 0).float().mean()) <= c.numerics.max_mismatch_fraction
    assert int((got != ref).sum()) < int((got != near).sum())
    assert torch.equal(run(*args, config={"SPLITS": splits, "BLOCK_N": 64}), got)  # again


@pytest.mark.parametrize("tokens", [1, 5, 16, 64])
@pytest.mark.parametrize("variant,config", [("triton_v1", None), ("triton_v2", None),
                                            ("triton_v2", {"GEMV_MAX_T": 16, "SPLIT_K": 1}),
                                            ("triton_v2", {"GEMV_MAX_T": 16, "SPLIT_K": 10,
                                                           "BLOCK_K": 512, "BLOCK_N": 16})])
def test_qkv_gate_proj_within_the_policy(tokens, variant, config):
    c = contract("qkv_gate_proj")
    args = c.make_inputs({"T": tokens, "H": 5120, "Hq": 6, "Hkv": 1, "D": 128}, 2, "cuda")
    run = Registry().load_variant("qkv_gate_proj", variant).run
    got = run(*args, config=config)
    for g, r, m in zip(got, c.reference(*args), c.numerics.magnitude(*args), strict=True):
        d = _ulps(g, r, m)
        assert int(d.max()) <= 1 and float((d > 0).float().mean()) <= 0.05
    again = run(*args, config=config)  # deterministic: the split partials in a fixed order
    assert all(torch.equal(a, g) for a, g in zip(again, got, strict=True))


def test_block_variants_decode_the_same_under_graph_replay(tmp_path):
    cfg = preset("tiny").replace(head_dim=128)
    path = write_demo_checkpoint(tmp_path / "demo128", config=cfg, seed=6)
    eng = LLMEngine(EngineConfig(model=str(path), device="cuda", dtype="bfloat16",
                                 kernels="reference", max_num_seqs=8, max_model_len=160,
                                 max_num_batched_tokens=64, cuda_graphs=False,
                                 kv_cache_bytes=256 * 2**20))
    reg = Registry()
    # The MoE reference syncs with the host (no capture): its capturable registry variant.
    ops = {op: reg.load_variant(op, v).run for op, v in BLOCK + (("moe_experts", "grouped_mm_v2"),)}
    eng.model.set_ops(OpTable(ops))
    eng.runner.batched_decode = True
    graphs = DecodeGraphs(eng.runner, max_num_seqs=8)
    notes = graphs.capture()
    assert graphs.ready, notes
    eng.runner.graphs = graphs
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(8, 2048, (n,), generator=g).tolist() for n in (1, 5, 17, 40, 23)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    replayed = [r.token_ids for r in eng.generate(prompts, params)]
    graphs.replay = False  # the same padded forward, eagerly
    assert [r.token_ids for r in eng.generate(prompts, params)] == replayed
    eng.cache.check_no_leaks(set())
