"""Where the FlashInfer backend and the torch backend part inside the engine (GPU diagnostic).

    python benchmarks/flashinfer_engine_diag.py --out DIR

Builds the head_dim-128 tiny demo checkpoint, runs the same prompts through two engines
(`--attention-backend torch` and `flashinfer`, eager), records every attention call's output
per layer for the first steps, and prints per step and layer: the pool (full / sliding), the
step's layout (decodes, chunks) and max |flashinfer - torch|. Also the greedy tokens of both and
of the cache-free full forward. Writes diag.json under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.config import preset  # noqa: E402
from model.demo import write_demo_checkpoint  # noqa: E402
from model.serve.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402


def _prompt(n: int) -> list[int]:  # as tests/test_serve_flashinfer.py makes them
    gen = torch.Generator().manual_seed(8)
    return [int(t) for t in torch.randint(8, 2048, (n,), generator=gen)]


PROMPTS = [_prompt(n) for n in (1, 5, 17, 40)]


def engine(path: Path, backend: str, graphs: bool = False) -> LLMEngine:
    """A small BF16 GPU engine, reference kernels (tests/test_serve_flashinfer.py uses it too)."""
    return LLMEngine(EngineConfig(model=str(path), device="cuda", dtype="bfloat16",
                                  kernels="reference", max_num_seqs=8, max_model_len=160,
                                  max_num_batched_tokens=64, cuda_graphs=graphs,
                                  kv_cache_bytes=256 * 2**20, attention_backend=backend))


def recorded(eng: LLMEngine, prompts, steps: int) -> tuple[list, list]:
    """(greedy tokens, [(layer, group, num_decode, bounds, out)] of every attention call)."""
    backend = eng.model.attention_backend
    calls = []
    inner = backend.__call__

    class Spy:
        def __getattr__(self, name):
            return getattr(backend, name)

        def __call__(self, layer, q, k, v, window, scale, batch):
            out = inner(layer, q, k, v, window, scale, batch)
            group = eng.cache.layer_cache(layer)[0]
            calls.append((layer, str(group), batch.num_decode, list(batch.seq_bounds),
                          q.float().cpu(), out.float().cpu()))
            return out

    eng.model.attention_backend = Spy()
    try:
        params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True)
        return [r.token_ids for r in eng.generate(prompts, params)], calls
    finally:
        eng.model.attention_backend = backend


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="diag-out")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = write_demo_checkpoint(Path(tempfile.mkdtemp()), config=preset("tiny").replace(
        head_dim=128), seed=6)
    report: dict = {}
    for label, prompts in (("single-1tok", PROMPTS[:1]), ("single-5tok", PROMPTS[1:2]),
                           ("batch", PROMPTS)):
        t_tok, t_calls = recorded(engine(ckpt, "torch"), prompts, 3)
        f_eng = engine(ckpt, "flashinfer")
        print(label, "backend:", f_eng.runner.attention_backend, f_eng.runner.notes[-1:])
        f_tok, f_calls = recorded(f_eng, prompts, 3)
        rows = []
        for i, (a, b) in enumerate(zip(t_calls, f_calls)):
            layer, group, nd, bounds, qa, oa = a
            qdiff = float((qa - b[4]).abs().max())
            diff = float((oa - b[5]).abs().max())
            per_tok = (oa - b[5]).abs().amax(dim=(1, 2)).tolist()
            rows.append({"call": i, "layer": layer, "group": group, "num_decode": nd,
                         "bounds": bounds, "q_diff": qdiff, "out_diff": diff,
                         "per_token": [round(x, 4) for x in per_tok[:12]],
                         "scale": float(oa.abs().max())})
            if i < 40 or diff > 0.1:
                print(f"{label} call {i:3d} layer {layer:2d} {group:5s} decodes {nd} "
                      f"bounds {bounds} q-diff {qdiff:.3g} out-diff {diff:.3g} "
                      f"per-token {[round(x, 3) for x in per_tok[:8]]}")
        report[label] = {"torch_tokens": t_tok, "flashinfer_tokens": f_tok, "calls": rows}
        print(label, "torch", t_tok, "\n", label, "flash", f_tok, flush=True)
    (out / "diag.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
