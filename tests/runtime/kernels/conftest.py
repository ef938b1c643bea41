"""The kernel tests: Triton's interpreter on CPU where there is no CUDA device (set before triton is
first imported), compiled kernels on CUDA where there is one; the whole folder is skipped where
triton is not installed."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton  # noqa: F401
    _TRITON_MISSING = None
except ImportError as e:   # pragma: no cover - CI installs the test extra
    _TRITON_MISSING = f"triton is not installed ({e}); pip install triton (the test extra has it)"

_HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    if _TRITON_MISSING is None:
        return
    skip = pytest.mark.skip(reason=_TRITON_MISSING)
    for item in items:
        if os.path.abspath(str(item.fspath)).startswith(_HERE):
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    """Where the kernels run: CUDA if present, else CPU under the interpreter."""
    return "cuda" if torch.cuda.is_available() else "cpu"
