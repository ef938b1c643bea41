"""Measuring saved activations the way a GPU would save them, on meta tensors (nothing allocated).

``saved_bytes(fn, *args, exclude=...)`` runs ``fn(*args)`` under
``torch.autograd.graph.saved_tensors_hooks`` and adds up every storage autograd saves for
backward, each once (views alias: storages are told apart by ``untyped_storage()`` identity —
on meta every ``data_ptr()`` is 0), leaving out the storages of ``exclude`` (the parameters:
weights a matmul saves are parameters, not activations). Only ops some input of which needs a
gradient save anything, as in a training step.

CUDA and CPU kernels save different tensors for the same call, and meta tensors take the CPU
decompositions. Two ops differ in what a transformer saves:

- ``F.dropout``: CUDA runs ``native_dropout`` and saves a bool mask (1 byte per element); CPU and
  meta compute ``x * mask`` and save the mask in x's dtype (2 bytes under bf16);
- ``F.scaled_dot_product_attention``: CUDA runs a fused kernel (flash attention without a mask,
  memory-efficient attention with one) that saves q, k, v, the output, the fp32 logsumexp and,
  with dropout, its RNG seed and offset; meta runs the math path, which saves the attention
  matrix (in fp32 for 16-bit inputs) several times.

``cuda_kernels()`` (a TorchFunctionMode, for eager models) and ``cuda_kernels_fx(gm)`` (a rewrite
of a traced or per-rank fx program) make those two calls run the CUDA kernels' aten ops, whose
meta implementations and autograd formulas are the ones CUDA uses: what is saved is then what a
GPU saves. (cuDNN attention, where torch selects it, saves the same tensors as flash.)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

aten = torch.ops.aten


def saved_bytes(fn, *args, exclude=(), detail: list | None = None, **kwargs) -> int:
    """Bytes of the distinct storages autograd saves while ``fn(*args, **kwargs)`` runs, minus
    those of the tensors in ``exclude``. ``detail``: a list to receive (shape, dtype, storage
    bytes) of each storage counted, in save order."""
    skip = {id(t.untyped_storage()) for t in exclude}
    keep = [t.untyped_storage() for t in exclude]   # alive, so their ids stay theirs
    seen: dict[int, object] = {}

    def pack(t):
        st = t.untyped_storage()
        if id(st) not in skip and id(st) not in seen:
            seen[id(st)] = st
            if detail is not None:
                detail.append((tuple(t.shape), t.dtype, st.nbytes()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args, **kwargs)
    del out, keep
    return sum(st.nbytes() for st in seen.values())


def cuda_dropout(input, p=0.5, training=True, inplace=False):
    """``F.dropout`` as CUDA runs it: ``native_dropout`` (saves a bool mask)."""
    x = input
    if not training or p == 0:
        return x
    return aten.native_dropout(x, p, True)[0]


def cuda_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` as CUDA runs it on A100/H100: flash attention for 16-bit
    inputs without a mask, memory-efficient attention otherwise (a bool mask becomes an additive
    mask in q's dtype first). Grouped-query attention repeats k and v as the math path would."""
    q, k, v = query, key, value
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    if attn_mask is None and q.dtype in (torch.float16, torch.bfloat16):
        return aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill(
            attn_mask.logical_not(), float("-inf"))
    return aten._scaled_dot_product_efficient_attention(q, k, v, attn_mask, True, dropout_p, is_causal,
                                                         scale=scale)[0]


def _cuda_aten_dropout(x, p, train):
    return cuda_dropout(x, p, train)


def _cuda_aten_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return cuda_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)


_ATEN = {aten.dropout.default: _cuda_aten_dropout, aten.scaled_dot_product_attention.default: _cuda_aten_sdpa}


class cuda_kernels(TorchFunctionMode):
    """Inside ``with cuda_kernels():`` eager ``F.dropout`` and ``F.scaled_dot_product_attention``
    (and their aten overloads) run the CUDA kernels' ops (module doc)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.dropout:
            return cuda_dropout(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            return cuda_sdpa(*args, **kwargs)
        if func in _ATEN:
            return _ATEN[func](*args, **kwargs)
        return func(*args, **kwargs)


def cuda_kernels_fx(gm: torch.fx.GraphModule, wrappers: dict | None = None) -> int:
    """Rewrite ``gm`` in place so its dropout and SDPA calls run the CUDA kernels' ops. A call
    that passes the op to a wrapper (``runtime.rng.seeded(aten.dropout.default, ...)``) is
    redirected to ``wrappers[wrapper]``, which receives the same arguments and should map the op
    through ``as_cuda``. Returns how many calls were rewritten."""
    wrappers = wrappers or {}
    n = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target in _ATEN:
            node.target = _ATEN[node.target]
            n += 1
        elif node.target in wrappers and node.args and node.args[0] in _ATEN:
            node.target = wrappers[node.target]
            n += 1
    gm.recompile()
    return n


def as_cuda(op):
    """The CUDA-kernel stand-in of an aten dropout / SDPA overload (else ``op`` itself)."""
    return _ATEN.get(op, op)
