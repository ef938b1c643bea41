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


_WARM = []


def warm_up_planning() -> None:
    """Plan a tiny model once in this (parent) process, so the forked ranks inherit what a first
    plan sets up (imports, first traces: about 6 s of a rank's 7 s plan of the tiny LLaMA) instead
    of each rank of each run paying it again. Single-threaded first: forked ranks deadlock in
    OpenMP if the parent ran multi-threaded ops."""
    if _WARM:
        return
    import autopar
    from autopar.models import ZOO
    torch.set_num_threads(1)
    model, batch = ZOO["llama"](**TINY)
    autopar.plan(model, batch, autopar.Cluster.preset("cpu", devices=2), constraints={"dp": 2}, kernels="triton")
    _WARM.append(True)
