"""Cheat (telling verification apart): the post-norm boundary exact at every depth but the last
layer's (add_index 104 and 105), where the scaled branch and residual are added in FP32 and
rounded once (the fp32_residual_add near miss). A random draw of the depth rarely hits those
two. Expected: rejected at the depth-index edge cases."""

from __future__ import annotations

import math

import torch


def _rms(x, w, eps):
    xf = x.float()
    return (w.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def run(branch, residual, post_weight, next_weight, add_index, eps, config=None):
    a, b = 1.0 / math.sqrt(add_index), math.sqrt((add_index - 1) / add_index)
    p = _rms(branch, post_weight, eps)
    if add_index >= 104:
        h = (p.float() * a + residual.float() * b).to(branch.dtype)
    else:
        h = p * a + residual * b
    return _rms(h, next_weight, eps), h
