"""GPT-2's fused qkv projection split into three projections for the codegen inference steps, so
a tp plan splits q, k and v (hence the KV cache) by heads, as Megatron does with its fused qkv.

GPT-2's attention computes ``self.c_attn(hidden).split(self.split_size, dim=2)`` with one Conv1D
``c_attn`` (weight [h, 3h]); a column split of its 3h outputs does not line up with the q/k/v
split. This module owns:

- ``split_fused_qkv(lm)``: a view of ``lm`` (the modules on the path to each GPT-2 ``attn``
  shallow-copied; ``lm`` itself is left as it was, its tensors shared) whose ``attn.c_attn`` is a
  ``SplitQKV``: children ``q``, ``k``, ``v`` (``ColumnsConv1D``: a Conv1D traced as an
  ``aten.linear`` over its transposed weight, which the Megatron policy splits) holding column
  slices of the fused weight and bias, returning ``cat([q(x), k(x), v(x)], -1)``; the blocks'
  other Conv1Ds (attention ``c_proj``, MLP ``c_fc`` / ``c_proj``) are ``ColumnsConv1D`` over the
  same tensors, so the plan makes them Megatron's column / row linears. ``Columns`` maps each view
  parameter to the model's (FQN, dim, start, stop, transposed). Only GPT-2 self-attention whose ``split_size`` is the
  hidden size and whose ``c_attn`` is a Conv1D of weight [h, 3h] is rewritten; any other attention
  keeps its fused projection (``unsplit`` says why), so a tp plan keeps its cache whole and the
  engines refuse it (their check of the cache bytes each rank holds against the priced).
- ``fold_cat_split(traced, module)``: the graph simplification the split needs: every
  ``split`` / ``split_with_sizes`` of a ``cat`` along the same dim whose pieces are the cat's
  inputs has its pieces replaced by those inputs (then each of q, k and v is column-parallel on
  heads); the blocks and fingerprint are found again.
- ``mapped_read(read, columns)``: a checkpoint reader (``read(fqn, slices)``) that reads a split
  parameter's block from the fused checkpoint tensor at its column offset.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn as nn

from autopar.frontend.trace import TracedGraph, find_blocks, fingerprint


@dataclass(frozen=True)
class Columns:
    """A view parameter's place in the model's: columns ``start:stop`` along ``dim`` of ``fqn``,
    transposed when ``transposed`` (a Conv1D weight [nx, nf] held as a linear's [nf, nx])."""
    fqn: str
    dim: int
    start: int
    stop: int
    transposed: bool = False


class ColumnsConv1D(nn.Module):
    """A Conv1D (``x @ W + bias``, W [nx, nf]) as a linear: ``weight`` is W transposed, [nf, nx]
    (a view of W's storage), ``forward`` an ``aten.linear`` straight on the parameter, which the
    Megatron policy pins column- or row-parallel (a Conv1D's ``addmm`` it leaves free, so a decode
    step's plan could keep q, k, v whole while the prefill's splits them)."""

    def __init__(self, w: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(w.t(), w.requires_grad)
        self.bias = nn.Parameter(bias, bias.requires_grad)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight, self.bias)


class SplitQKV(nn.Module):
    """A GPT-2 ``c_attn`` (Conv1D [h, 3h]) as three ``ColumnsConv1D`` children ``q``, ``k``, ``v``
    (each [h, h], the fused weight's and bias's column slices, sharing their storage); ``forward``
    returns the fused output ``cat([q(x), k(x), v(x)], -1)``."""

    def __init__(self, fused: nn.Module):
        super().__init__()
        h = fused.weight.shape[1] // 3
        for i, name in enumerate("qkv"):
            cols = slice(i * h, (i + 1) * h)
            setattr(self, name, ColumnsConv1D(fused.weight[:, cols], fused.bias[cols]))

    def forward(self, x):
        return torch.cat([self.q(x), self.k(x), self.v(x)], -1)


def _provable(attn) -> str | None:
    """Why GPT-2 attention ``attn``'s ``c_attn`` cannot be split into q, k, v (None: it can)."""
    c = attn.c_attn
    h = attn.embed_dim
    if getattr(attn, "is_cross_attention", False):
        return "a cross-attention c_attn (k and v only)"
    if type(c).__name__ != "Conv1D" or c.weight.dim() != 2 or c.bias is None:
        return f"c_attn is a {type(c).__name__}, not a Conv1D with a bias"
    if attn.split_size != h or tuple(c.weight.shape) != (h, 3 * h) or tuple(c.bias.shape) != (3 * h,):
        return (f"split_size {attn.split_size} and c_attn weight {tuple(c.weight.shape)} are not the hidden size "
                f"{h} and [{h}, {3 * h}]")
    return None


def _copied_path(root: nn.Module, path: list[str], copies: dict) -> nn.Module:
    """The module at ``path`` under ``root``'s copy, every module on the way shallow-copied once
    (``copies``: id -> copy) with its own child dict, so replacing a child leaves the original."""
    def fresh(m):
        if id(m) not in copies:
            c = copy.copy(m)
            c._modules = dict(m._modules)
            copies[id(m)] = c
        return copies[id(m)]

    node = fresh(root)
    for name in path:
        child = fresh(node._modules[name])
        node._modules[name] = child
        node = child
    return node


def unsplit(lm: nn.Module) -> dict[str, str]:
    """The GPT-2 attentions of ``lm`` whose ``c_attn`` ``split_fused_qkv`` leaves fused: FQN -> why."""
    return {n: why for n, m in lm.named_modules() if type(m).__name__ == "GPT2Attention"
            for why in [_provable(m)] if why is not None}


def split_fused_qkv(lm: nn.Module) -> tuple[nn.Module, dict[str, Columns]]:
    """``lm`` with every GPT-2 self-attention's ``c_attn`` that provably packs [q | k | v] a
    ``SplitQKV`` (a view: ``lm`` is unchanged), and each new parameter's ``Columns`` (FQNs of
    ``lm``); ``lm`` itself and no map when there is none (``unsplit``: those left fused)."""
    attns = [(n, m) for n, m in lm.named_modules() if type(m).__name__ == "GPT2Attention" and _provable(m) is None]
    if not attns:
        return lm, {}
    copies: dict = {}
    columns: dict[str, Columns] = {}
    for name, attn in attns:
        new_attn = _copied_path(lm, name.split("."), copies)
        new_attn._modules["c_attn"] = SplitQKV(attn.c_attn)
        h = attn.embed_dim
        for i, part in enumerate("qkv"):
            columns[f"{name}.c_attn.{part}.weight"] = Columns(f"{name}.c_attn.weight", 1, i * h, (i + 1) * h, True)
            columns[f"{name}.c_attn.{part}.bias"] = Columns(f"{name}.c_attn.bias", 0, i * h, (i + 1) * h)
    # the blocks' other Conv1Ds (attention output, MLP) as linears over the same parameters
    for name, m in lm.named_modules():
        if type(m).__name__ in ("GPT2Attention", "GPT2MLP"):
            for child in ("c_proj", "c_fc"):
                conv = m._modules.get(child)
                if type(conv).__name__ == "Conv1D" and conv.bias is not None:
                    owner = _copied_path(lm, name.split("."), copies)
                    owner._modules[child] = ColumnsConv1D(conv.weight, conv.bias)
                    nf = conv.weight.shape[1]
                    columns[f"{name}.{child}.weight"] = Columns(f"{name}.{child}.weight", 1, 0, nf, True)
    return copies[id(lm)], columns


_CAT = (torch.ops.aten.cat.default,)
_SPLITS = (torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default)


def _dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _folds(split) -> list | None:
    """The cat inputs that replace ``split``'s pieces, or None when they do not line up."""
    src = split.args[0]
    if not (getattr(src, "op", None) == "call_function" and src.target in _CAT):
        return None
    pieces = src.args[0]
    val = src.meta.get("val")
    if val is None or any("val" not in p.meta for p in pieces):
        return None
    rank = val.dim()
    cat_dim = _dim(src.args[1] if len(src.args) > 1 else src.kwargs.get("dim", 0), rank)
    split_dim = _dim(split.args[2] if len(split.args) > 2 else split.kwargs.get("dim", 0), rank)
    if cat_dim != split_dim:
        return None
    sizes = [p.meta["val"].shape[cat_dim] for p in pieces]
    total = val.shape[cat_dim]
    arg = split.args[1]
    if isinstance(arg, int):
        want = [arg] * (total // arg) + ([total % arg] if total % arg else [])
    else:
        want = list(arg)
    return list(pieces) if want == sizes else None


def fold_cat_split(traced: TracedGraph, module: nn.Module) -> TracedGraph:
    """``traced`` (changed in place and returned) with each ``split`` of a ``cat`` whose pieces are
    the cat's inputs folded: the pieces' ``getitem`` users read the inputs, the dead nodes erased;
    its blocks and fingerprint found again over ``module`` (the traced one). Unchanged when none."""
    import operator
    graph = traced.gm.graph
    folded = 0
    for split in list(graph.nodes):
        if split.op != "call_function" or split.target not in _SPLITS:
            continue
        pieces = _folds(split)
        if pieces is None or not all(u.target is operator.getitem for u in split.users):
            continue
        for user in list(split.users):
            user.replace_all_uses_with(pieces[user.args[1]])
        folded += 1
    if not folded:
        return traced
    graph.eliminate_dead_code()
    traced.gm.recompile()
    traced.blocks, traced.block_of = find_blocks(traced.gm, module, traced.param_fqn, traced.buffers)
    traced.fingerprint = fingerprint(traced.gm, traced.param_fqn, traced.buffers)
    traced.op_specs.clear()
    traced.needs_grad_memo.clear()
    return traced


def mapped_read(read, columns: dict[str, Columns]):
    """``read(fqn, slices)`` (a checkpoint's blocks, FQNs of the model) for FQNs of its split view:
    a view parameter's block is the model tensor's (``Columns``), its slice along ``dim`` shifted by
    ``start``, transposed back when ``transposed``."""
    if read is None or not columns:
        return read

    def mapped(fqn: str, slices):
        col = columns.get(fqn)
        if col is None:
            return read(fqn, slices)
        sl = list(slices) + [slice(None)] * (col.dim + 1 - len(slices))
        if col.transposed:
            sl = sl[::-1]
        width = col.stop - col.start
        a, b, step = sl[col.dim].indices(width)
        if step != 1:
            raise ValueError(f"{fqn}: a strided block {sl[col.dim]} of a split parameter")
        sl[col.dim] = slice(col.start + a, col.start + b)
        block = read(col.fqn, tuple(sl))
        return block.t().contiguous() if col.transposed else block

    return mapped


__all__ = ["Columns", "ColumnsConv1D", "SplitQKV", "fold_cat_split", "mapped_read", "split_fused_qkv", "unsplit"]
