"""The evaluation harness on a GPU: ceilings, the adversarial corpus under strict judging, timings.

    python benchmarks/eval_harness_gpu.py --out $OUT          # on the H200 (about 5-10 minutes)
    python -m pytest -q -m gpu tests/test_eval_gpu.py         # the same facts, as assertions

Writes under --out:
    ceilings.json        measured copy bandwidth and BF16/FP32 matmul rates (refreshed)
    corpus_cuda.json     every tests/adversarial variant verified on cuda at real TP8 shapes:
                         verdict, reasons, and whether the reason is the expected one
    bench_swiglu.json    the honest Triton swiglu vs the reference and torch.compile at decode
                         (T = 1, 8, 32, 128) and prefill (T = 2048, 16384) shapes
    floor_demo.json      a pointer-caching cheat timed at a large shape: flagged below the floor
    summary.txt          one line per result
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # a plain checkout works too (no `pip install -e .` needed)

DECODE_PREFILL_TOKENS = (1, 8, 32, 128, 2048, 16384)


def corpus(out: Path, lines: list[str]) -> None:
    from autoopt.eval.shapes import gpu_shapes
    from autoopt.eval.verify import verify_variant
    from tests.test_eval_adversarial import CORPUS, HANG_TIMEOUT_S, PASSING, REJECTED

    results = {}
    items = [(s, op, need) for s, (op, need) in REJECTED.items()]
    items += [(s, op, ()) for s, op in PASSING.items()]
    for stem, op, needles in items:
        start = time.monotonic()
        rep = verify_variant(op, CORPUS / f"{stem}.py", device="cuda", seeds=(0, 1, 2),
                             shapes=gpu_shapes(op, (1, 17, 128, 515)),
                             timeout_s=HANG_TIMEOUT_S * 3 if stem == "hangs" else 600)
        text = "\n".join(rep.reasons)
        expected = rep.verdict == "pass" if not needles else (
            rep.verdict == "reject" and all(n in text for n in needles))
        results[stem] = {"op": op, "verdict": rep.verdict, "reasons": rep.reasons,
                         "as_expected": expected, "elapsed_s": time.monotonic() - start,
                         "numerics": rep.checks.get("numerics"), "floor": rep.checks.get("floor")}
        lines.append(f"corpus {stem:24s} {rep.verdict:6s} expected={expected} "
                     f"{rep.reasons[0][:100] if rep.reasons else ''}")
    (out / "corpus_cuda.json").write_text(json.dumps(results, indent=2, default=str))


def bench(out: Path, lines: list[str]) -> None:
    from autoopt.eval.shapes import gpu_shapes
    from autoopt.eval.timing import bench_op

    corpus_dir = REPO / "tests" / "adversarial"
    rows = bench_op("swiglu", corpus_dir / "honest_triton_swiglu.py",
                    gpu_shapes("swiglu", DECODE_PREFILL_TOKENS), "cuda")
    (out / "bench_swiglu.json").write_text(json.dumps([r.to_dict() for r in rows], indent=2))
    for r in rows:
        lines.append(f"bench swiglu T={r.shape['T']:6d} {r.median_us:9.2f} us iqr {r.iqr_us:.2f} "
                     f"x_ref {r.x_reference:.2f} x_compile {r.x_compile or 0:.2f} "
                     f"floor {r.pct_of_floor:.1f}% {r.method} {'; '.join(r.notes)}")
    shape = gpu_shapes("attn_output_gate", (16384,))
    (row,) = bench_op("attn_output_gate", corpus_dir / "pointer_cache.py", shape, "cuda",
                      compile=False)
    (out / "floor_demo.json").write_text(json.dumps(row.to_dict(), indent=2))
    lines.append(f"floor demo (pointer cache): {row.median_us:.2f} us vs floor "
                 f"{row.floor_us:.2f} us, floor_ok={row.floor_ok}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "eval-gpu-out")))
    ap.add_argument("--skip-corpus", action="store_true")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    from autoopt.eval.timing import measure_ceilings

    if not torch.cuda.is_available():
        print("error: no CUDA GPU; this script measures the harness on a GPU", file=sys.stderr)
        return 2
    c = measure_ceilings("cuda", refresh=True)
    (args.out / "ceilings.json").write_text(json.dumps(c.__dict__, indent=2))
    lines = [f"ceilings {c.gpu}: copy {c.copy_bytes_s / 1e12:.2f} TB/s, bf16 "
             f"{c.bf16_flops_s / 1e12:.0f} TFLOP/s, fp32 {c.fp32_flops_s / 1e12:.1f} TFLOP/s"]
    bench(args.out, lines)
    if not args.skip_corpus:
        corpus(args.out, lines)
    (args.out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
