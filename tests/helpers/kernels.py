"""What the kernel tests share: skip honestly where no kernel can run (neither CUDA nor Triton's
interpreter, which tests/runtime/kernels/conftest.py sets on a CPU machine)."""
from __future__ import annotations

import os

import pytest
import torch


def needs_kernels() -> None:
    if not os.environ.get("TRITON_INTERPRET") and not torch.cuda.is_available():
        pytest.skip("needs CUDA or the Triton interpreter (tests/runtime/kernels/conftest.py sets it on CPU)")


# The training tests' model sizes under the interpreter. A row kernel (the norms, softmax, the fused
# LM head's row statistics and gradient) launches one program per row of batch x seq (softmax: x
# heads), each costing tens of milliseconds interpreted, and the norms' backward loops over the
# rows too: the zoo's defaults (batch 8, seq 16: 128 rows) made these tests minutes long. batch 2 x
# seq 8 (16 rows) still splits in two on the batch (dp) and the sequence (sp: ulysses, megatron,
# ring's 2 x 2 chunks). The hidden sizes, which set the kernels' blocks (and whether they mask),
# stay the zoo's.
TINY = {"batch": 2, "seq": 8}
TRAIN_STEPS = 2   # the second step's loss and the final state both read the first update
