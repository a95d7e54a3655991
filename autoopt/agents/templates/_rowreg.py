"""Helpers of the `rowreg` family (norm_residual_norm, allreduce_norm_residual_norm): one row per
program held whole in registers, `tl.sum` for the sums of squares (Triton's tree, not torch's
lane order: within the ops' ulp policy, not bitwise).

Snippet sections, inlined by template.py for `# {{rowreg.NAME}}: names` template lines: the
format and the rules are in _common.py's docstring.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


# A rounding to BF16 and back, a multiply never contracted into an FMA, rsqrt(mean + eps) with
# torch's mean (CUDA: sum * f32(1/N); CPU: sum / N).
# {{snippet ops}}
@triton.jit
def _round(x):
    return _bf16_to_f32(_f32_to_bf16(x))


@triton.jit
def _mul(a, b, ON_GPU: tl.constexpr):
    if ON_GPU:
        return libdevice.mul_rn(a, b)  # never contracted into an FMA
    else:
        return a * b


@triton.jit
def _inv_rms(total, inv_n, n, eps, ON_GPU: tl.constexpr):
    if ON_GPU:
        mean = libdevice.mul_rn(total, inv_n)  # torch's CUDA mean: sum * f32(1/N)
        return libdevice.rsqrt(libdevice.add_rn(mean, eps))
    else:
        mean = tl.div_rn(total, n * 1.0)  # torch's CPU mean: sum / N
        return tl.rsqrt(mean + eps)
# {{end}}


# Outside every section, so never rendered: the names the sections use, for this file to be
# valid Python. The templates take the real conversions from _common.py.
_bf16_to_f32 = _f32_to_bf16 = None


# The sandwich boundary on one row held in registers, from the (rank-summed) branch x: p, the
# depth-scaled residual add (stored), the next norm (stored).
# {{snippet sandwich}}
@triton.jit
def _sandwich(x, h, w_post, w_next, new_res_out, normed_out, m, inv_n, eps, scale_a, scale_b,
              N: tl.constexpr, ON_GPU: tl.constexpr):
    r_post = _inv_rms(tl.sum(_mul(x, x, ON_GPU), axis=0), inv_n, N, eps, ON_GPU)
    p = _round(_mul(w_post, _mul(x, r_post, ON_GPU), ON_GPU))
    pa = _round(_mul(p, scale_a, ON_GPU))
    hb = _round(_mul(h, scale_b, ON_GPU))
    h_new = _f32_to_bf16(pa + hb)
    tl.store(new_res_out, h_new, mask=m)
    hf = _bf16_to_f32(h_new)
    r_next = _inv_rms(tl.sum(_mul(hf, hf, ON_GPU), axis=0), inv_n, N, eps, ON_GPU)
    tl.store(normed_out, _f32_to_bf16(_mul(w_next, _mul(hf, r_next, ON_GPU), ON_GPU)), mask=m)
# {{end}}
