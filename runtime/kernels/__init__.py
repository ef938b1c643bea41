"""Triton kernels of the runtime: RMSNorm (with a fused residual add), SwiGLU, LayerNorm, GeGLU,
fused linear + cross-entropy (vocabulary-parallel too) and a fused AdamW step, each beside its plain-torch
reference; whether they can run here (``available``) and how many times each family launched.

Triton is imported only by the kernel modules, and only if installed: ``import runtime`` and
``import runtime.kernels`` work without it, and so do the ``*_reference`` functions. Kernels run
on CUDA tensors, or on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, set before
triton is first imported).
"""
from __future__ import annotations

import os

FAMILIES = ("rms_norm", "swiglu", "layer_norm", "geglu", "linear_cross_entropy", "adamw")

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
