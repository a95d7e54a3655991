"""Shared test setup: the Triton interpreter on CPU, one seed fixture, GPU tests skipped on CPU."""

from __future__ import annotations

import os

# Must be set before triton is imported anywhere: without a GPU, Triton kernels run on CPU
# tensors through the interpreter.
try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# rich wraps at 80 columns when there is no terminal (CI has neither a TTY nor COLUMNS): tests
# that read console output see one stable width instead of the machine's.
os.environ["COLUMNS"] = "200"

import pytest  # noqa: E402

pytest_plugins = ["tests.failure_log"]  # AUTOOPT_TEST_FAILURES=FILE: tracebacks as they happen


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
