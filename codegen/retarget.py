"""dtype and device arguments of the traced graph, rewritten for one rank's program.

Mixed precision (``compute_dtype`` bf16/fp16): the model was traced in fp32, so dtype arguments
in the graph (``x.to(torch.float32)``, ``full(..., dtype=torch.float32)``) name fp32; they are
rewritten to the compute dtype, so every floating value of the program has the dtype of the
working parameters (what the planner's bf16 memory and communication model counts). Ops that
need fp32 internally (the vocab-parallel cross-entropy) upcast locally.

Device (``device``, e.g. ``cuda:3`` under NCCL): the graph was traced on the CPU (or meta), so
``device=`` arguments of factory ops (``arange``, ``full``, ``ones``) are rewritten to the
rank's device; with ``None`` they are left as traced.

``retarget`` rewrites one call's arguments; ``retarget_module`` a copy of a higher-order op's body
(e.g. of ``wrap_with_set_grad_enabled``), its buffers included. codegen/per_rank.py calls both.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree


def retarget(args, kwargs, compute_dtype, device):
    """dtype and device arguments for this rank's program (module doc); ``compute_dtype`` None
    for fp32, ``device`` None to leave them as traced."""
    if compute_dtype is not None:
        args, kwargs = pytree.tree_map_only(
            torch.dtype, lambda d: compute_dtype if d == torch.float32 else d, (args, kwargs))
    if device is not None:
        args, kwargs = pytree.tree_map_only(torch.device, lambda _: device, (args, kwargs))
    return args, kwargs


def retarget_module(gm: fx.GraphModule, compute_dtype, device) -> fx.GraphModule:
    """A copy of a higher-order op's body with its dtype/device arguments retargeted."""
    if compute_dtype is None and device is None:
        return gm
    import copy

    gm = copy.deepcopy(gm)
    for node in gm.graph.nodes:
        node.args, node.kwargs = retarget(node.args, node.kwargs, compute_dtype, device)
    for name, sub in list(gm.named_children()):
        if isinstance(sub, fx.GraphModule):
            setattr(gm, name, retarget_module(sub, compute_dtype, device))
    for name, buf in list(gm.named_buffers(recurse=False)):
        setattr(gm, name, buf.to(compute_dtype or buf.dtype) if buf.is_floating_point() else buf)
    gm.recompile()
    return gm
