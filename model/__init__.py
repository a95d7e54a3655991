"""The Beam model and its serving runtime. `from model import load_model`."""

from __future__ import annotations

from .beam import BeamForCausalLM
from .config import BeamConfig, preset
from .weights import CheckpointError, load_model

__all__ = ["BeamConfig", "BeamForCausalLM", "CheckpointError", "load_model", "preset"]
