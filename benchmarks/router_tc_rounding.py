"""How a tensor core's FP32 accumulation would move the router's weights: an emulation on the CPU.

    python benchmarks/router_tc_rounding.py --out DIR [--tokens 32] [--seeds 0,1]

The router's three-term BF16 GEMM (`kernels/router/triton_v5.py`) gets exact products from the
tensor cores, but their FP32 sums need not be rounded to nearest: published measurements of
NVIDIA tensor cores (V100, T4, A100) find each block of products added to the accumulator and
the result truncated toward zero. This script emulates that (each k-block's exact sum added to the
accumulator in FP64, then rounded toward zero to FP32) for two ways of accumulating:
  one_accumulator  every term and K step into one tensor-core accumulator (truncation relative
                   to the running logit, ~1000 times over H = 5120: biased toward zero)
  per_step         a fresh tensor-core sum each K step, added to the total on the CUDA cores
                   (FP32, round to nearest): what triton_v5 does
and, for scale, `fp32_chunks` (round-to-nearest FP32 sums of 256-deep chunks, a split-K GEMV).
For each it routes with the reference's ids and prints the judge's verdict on the weights (the
op's ulp policy, `autoopt.eval.numerics.judge`) and the logits' error in ulps of the sum of
|products| (signed toward the logit's sign: negative means toward zero). Writes results.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoopt.eval.numerics import OutputStats, effective_policy, judge  # noqa: E402
from model.ops import CONTRACTS  # noqa: E402

MODES = ("one_accumulator", "per_step", "fp32_chunks")


def split3(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """triton_v5's split: the weight's bits with the low 16 cleared, twice, and the rest."""
    w1 = (w.view(np.int32) & np.int32(-65536)).view(np.float32)
    r = (w - w1).astype(np.float32)
    w2 = (r.view(np.int32) & np.int32(-65536)).view(np.float32)
    return w1, w2, (r - w2).astype(np.float32)


def _toward_zero(x: np.ndarray) -> np.ndarray:
    f = x.astype(np.float32)
    over = np.abs(f.astype(np.float64)) > np.abs(x)
    f[over] = np.nextafter(f[over], np.float32(0))
    return f


def tc_logits(h: np.ndarray, w: np.ndarray, mode: str, block: int = 16,
              step: int = 64) -> np.ndarray:
    """Logits [T, E] of BF16-valued h [T, K] and FP32 w [E, K] under `mode`."""
    k_dim = h.shape[1]
    if mode == "fp32_chunks":
        acc = np.zeros((h.shape[0], w.shape[0]), np.float32)
        for k0 in range(0, k_dim, 256):
            chunk = h[:, k0:k0 + 256].astype(np.float64) @ w[:, k0:k0 + 256].T.astype(np.float64)
            acc = (acc + chunk.astype(np.float32)).astype(np.float32)
        return acc
    terms = split3(w)
    acc = np.zeros((h.shape[0], w.shape[0]), np.float32)
    for k0 in range(0, k_dim, step):
        part = np.zeros_like(acc) if mode == "per_step" else acc
        for term in (terms[2], terms[1], terms[0]):  # the smallest first, as the kernel does
            for b0 in range(k0, min(k0 + step, k_dim), block):
                exact = h[:, b0:b0 + block].astype(np.float64) @ \
                    term[:, b0:b0 + block].T.astype(np.float64)
                part = _toward_zero(part.astype(np.float64) + exact)
        acc = (acc + part).astype(np.float32) if mode == "per_step" else part
    return acc


def evaluate(tokens: int, seed: int, mode: str) -> dict:
    c = CONTRACTS["router"]
    args = c.make_inputs({"T": tokens, "H": 5120, "E": 256}, seed)
    h, w = args[0].float().numpy(), args[1].numpy()
    ref_w, ref_ids = c.reference(*args)
    logits = tc_logits(h, w, mode)
    s = torch.sigmoid(torch.from_numpy(logits)).gather(1, ref_ids)
    got = s / (s.sum(-1, keepdim=True) + 1e-20)
    stats = OutputStats()
    stats.add(got, ref_w, torch.ones_like(ref_w, dtype=torch.bool))
    reasons = judge(effective_policy(c.numerics, torch.float32, "cuda"), stats, "weights")
    exact = h.astype(np.float64) @ w.astype(np.float64).T
    scale = np.abs(h).astype(np.float64) @ np.abs(w).astype(np.float64).T
    err = (logits - exact) / np.spacing(scale.astype(np.float32)).astype(np.float64) \
        * np.sign(exact)
    ulps = (got.view(torch.int32).long() - ref_w.view(torch.int32).long()).abs()
    return {"mode": mode, "tokens": tokens, "seed": seed, "passes": not reasons,
            "reasons": reasons, "weights_max_ulp": int(ulps.max()),
            "logit_err_mean": float(err.mean()), "logit_err_max": float(np.abs(err).max())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--modes", default=",".join(MODES))
    a = p.parse_args(argv)
    rows = [evaluate(a.tokens, int(seed), mode) for mode in a.modes.split(",")
            for seed in a.seeds.split(",")]
    for r in rows:
        print(f"{r['mode']:16s} seed {r['seed']}: {'pass' if r['passes'] else 'REJECT'}; "
              f"weights max {r['weights_max_ulp']} ulp; logit error (ulps of sum |products|, "
              f"toward the sign) mean {r['logit_err_mean']:+.2f}, max {r['logit_err_max']:.1f}")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
