"""The GEMM precision the op contracts assume on CUDA: FP32 accumulation, one rounding.

PyTorch lets cuBLAS trade precision for speed in two ways the contracts (docs/numerics.md) do
not have:
- TF32 for FP32 GEMMs (`torch.backends.cuda.matmul.allow_tf32`, off by default);
- reduced-precision reductions for BF16 and FP16 GEMMs
  (`allow_bf16_reduced_precision_reduction`, `allow_fp16_reduced_precision_reduction`, both on
  by default): a split-K kernel may add its partial sums in BF16, one more rounding per split.

cuBLAS picks such a split-K kernel by shape. On an H200 it does so for GEMMs of a few rows with
K = 349 or 92 (the MoE reference at T = 10, H = 349, I = 92 differs from itself with the flag
off in 52-62% of its outputs, by up to 2 ulps), and not at the model's widths (H = 5120, I =
320: no difference). So the default changes nothing the model serves, and everything a judge
compares at other widths: a kernel that keeps the contract looks wrong beside a reference that
does not. The judge computes references under `contract_precision()`; the serving engine and
each TP rank set the same flags for their whole process (`use_contract_precision()`), and the
worker that runs a candidate sets the flags its judge sends (`contract_flags()`; it imports no
model code), so a variant is judged as it serves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

# torch.backends.cuda.matmul attribute -> the value the contracts assume
FLAGS = {"allow_tf32": False, "allow_bf16_reduced_precision_reduction": False,
         "allow_fp16_reduced_precision_reduction": False}
CUDNN_TF32 = False


def _matmul():
    return torch.backends.cuda.matmul


def current() -> dict[str, bool]:
    m = _matmul()
    return {**{k: bool(getattr(m, k)) for k in FLAGS if hasattr(m, k)},
            "cudnn.allow_tf32": bool(torch.backends.cudnn.allow_tf32)}


def contract_flags() -> dict[str, bool]:
    """The flags `current()` reports under the contracts' precision (for another process)."""
    return {**FLAGS, "cudnn.allow_tf32": CUDNN_TF32}


def use_contract_precision() -> None:
    """Set the contracts' GEMM precision for this whole process."""
    m = _matmul()
    for k, v in FLAGS.items():
        if hasattr(m, k):
            setattr(m, k, v)
    torch.backends.cudnn.allow_tf32 = CUDNN_TF32


@contextlib.contextmanager
def contract_precision() -> Iterator[None]:
    """The contracts' GEMM precision inside the block; the previous flags restored after."""
    m = _matmul()
    saved = {k: getattr(m, k) for k in FLAGS if hasattr(m, k)}
    cudnn = torch.backends.cudnn.allow_tf32
    use_contract_precision()
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(m, k, v)
        torch.backends.cudnn.allow_tf32 = cudnn
