"""autoopt: agents write, verify and tune fused kernels for Beam, and the runtime serves them."""

from __future__ import annotations

__version__ = "0.1.0"
