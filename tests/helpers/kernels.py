"""What the kernel tests share: skip honestly where no kernel can run (neither CUDA nor Triton's
interpreter, which tests/runtime/kernels/conftest.py sets on a CPU machine)."""
from __future__ import annotations

import os

import pytest
import torch


def needs_kernels() -> None:
    if not os.environ.get("TRITON_INTERPRET") and not torch.cuda.is_available():
        pytest.skip("needs CUDA or the Triton interpreter (tests/runtime/kernels/conftest.py sets it on CPU)")
