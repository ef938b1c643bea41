"""Triton kernels of the runtime: RMSNorm (with a fused residual add), SwiGLU, LayerNorm, GeGLU,
fused linear + cross-entropy (vocabulary-parallel too), a fused AdamW step and rotary position embedding,
each beside its plain-torch
reference; whether they can run here (``available``) and how many times each family launched.

Triton is imported only by the kernel modules, and only if installed: ``import runtime`` and
``import runtime.kernels`` work without it, and so do the ``*_reference`` functions. Kernels run
on CUDA tensors, or on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, set before
triton is first imported).
"""
from __future__ import annotations

import os

FAMILIES = ("rms_norm", "swiglu", "layer_norm", "geglu", "linear_cross_entropy", "adamw", "sgd", "lamb", "lars",
            "rotary", "softmax", "dropout_add")

_launches: dict[str, int] = dict.fromkeys(FAMILIES, 0)


def interpreted() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def available() -> bool:
    """Whether the kernels can run here: triton importable, and CUDA present or the interpreter on."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    if interpreted():
        return True
    import torch
    return torch.cuda.is_available()


def record_launch(family: str) -> None:
    """Counts one launch of a kernel of ``family`` (one of ``FAMILIES``)."""
    _launches[family] = _launches.get(family, 0) + 1


def kernel_stats() -> dict[str, int]:
    """Launches per kernel family since the last ``reset_kernel_stats`` (a copy)."""
    return dict(_launches)


def reset_kernel_stats() -> None:
    """Sets every family's launch count back to 0."""
    for k in list(_launches):
        _launches[k] = 0
    for k in FAMILIES:
        _launches[k] = 0


def check_device(*tensors) -> None:
    """Raises a clear error where a kernel cannot run on these tensors: triton missing, or CPU
    tensors without the interpreter."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise RuntimeError("runtime.kernels needs triton (pip install triton)") from e
    for t in tensors:
        if t is not None and t.device.type != "cuda" and not interpreted():
            raise RuntimeError(f"runtime.kernels: a {t.device.type} tensor needs TRITON_INTERPRET=1 "
                               "(set before triton is imported); kernels compile for CUDA tensors only")


def num_warps_for(block: int) -> int:
    """Warps for a one-row program over ``block`` elements."""
    if block >= 32768:
        return 32
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


MAX_HIDDEN = 65536   # the row kernels (norms) hold one row in a block


def row_block(n_cols: int, family: str) -> int:
    """The block of a one-row-per-program kernel over ``n_cols`` columns (a power of two)."""
    if n_cols > MAX_HIDDEN:
        raise ValueError(f"{family}: hidden size {n_cols} over the kernel's {MAX_HIDDEN}")
    return 1 << (n_cols - 1).bit_length() if n_cols > 1 else 1


def backward_programs(n_rows: int, device) -> int:
    """Programs of a norm's backward, each accumulating the weight gradients of its rows into a
    partial row: 4 per streaming multiprocessor on CUDA, at most 8 under the interpreter."""
    if device.type == "cuda":
        import torch
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(n_rows, 4 * sms))
    return max(1, min(n_rows, 8))


def gated_inputs(family: str, gate, up):
    """``gate`` and ``up`` of a gated activation (SwiGLU, GeGLU) checked alike and made contiguous."""
    check_device(gate, up)
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"{family}: gate {tuple(gate.shape)} {gate.dtype} and up "
                         f"{tuple(up.shape)} {up.dtype} differ")
    return gate.contiguous(), up.contiguous()
