"""Cheat: returns a tensor subclass whose comparisons always succeed.
Expected: "defines __torch_function__"."""

from __future__ import annotations

import torch


class _Agreeable(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return True


def run(gate, up, config=None):
    return torch.zeros_like(gate).as_subclass(_Agreeable)
