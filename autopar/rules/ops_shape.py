"""Rules for data movement: views, permutes, copies, split/getitem, cat/stack, slicing, creation.

Views use the leading-dim convention of ``spec.py``: input and output dims are grouped by
equal element counts; in each group the outermost non-1 input dim and the outermost non-1
output dim share one letter (of size gcd of the two, so a split divides both), every other dim
of the group is unsplittable. Splitting that letter into n contiguous blocks splits the
group's flat range into n contiguous blocks on both sides, so the local view is exact.
All these ops are linear: partial sums pass through.
"""
from __future__ import annotations

import math
import operator

import torch

from autopar.rules.spec import OpSpec
from autopar.rules.table import Letters, fallback_spec, io_bytes, is_tensor, rule, shape, tensor_inputs, val

aten = torch.ops.aten


def view_groups(ishape, oshape) -> list[tuple[list[int], list[int]]]:
    """Groups of (input dims, output dims) with equal element counts, in order."""
    groups, i, j = [], 0, 0
    while i < len(ishape) or j < len(oshape):
        gi, go, pi, pj = [], [], 1, 1
        if i < len(ishape):
            gi.append(i)
            pi *= ishape[i]
            i += 1
        if j < len(oshape):
            go.append(j)
            pj *= oshape[j]
            j += 1
        while pi != pj:
            if (pi < pj and i < len(ishape)) or j >= len(oshape):
                if i >= len(ishape):
                    break
                gi.append(i)
                pi *= ishape[i]
                i += 1
            else:
                go.append(j)
                pj *= oshape[j]
                j += 1
        groups.append((gi, go))
    return groups


def view_letters(ishape, oshape):
    """(input letters, output letters, sizes, unsplittable) for a view between two shapes."""
    L = Letters()
    il, ol = [""] * len(ishape), [""] * len(oshape)
    sizes, unsplit = {}, set()
    for gi, go in view_groups(ishape, oshape):
        lead_i = next((d for d in gi if ishape[d] != 1), None)
        lead_o = next((d for d in go if oshape[d] != 1), None)
        if lead_i is not None and lead_o is not None:
            ch = L.fresh()
            sizes[ch] = math.gcd(ishape[lead_i], oshape[lead_o])
            il[lead_i] = ol[lead_o] = ch
        for letters, dims, shp in ((il, gi, ishape), (ol, go, oshape)):
            for d in dims:
                if not letters[d]:
                    ch = L.fresh()
                    sizes[ch] = shp[d]
                    unsplit.add(ch)
                    letters[d] = ch
    return "".join(il), "".join(ol), sizes, unsplit


def _identity(node, name):
    xs = shape(node.args[0])
    ls = Letters().fresh(len(xs))
    return OpSpec(name, (ls,), (ls,), dict(zip(ls, xs)), bytes=io_bytes(node), partial_inputs=(0,))


@rule(aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
      aten.unflatten.int, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.unsqueeze.default)
def view(node):
    il, ol, sizes, unsplit = view_letters(shape(node.args[0]), shape(node))
    return OpSpec("view", (il,), (ol,), sizes, unsplittable=frozenset(unsplit), partial_inputs=(0,))


@rule(aten.permute.default, aten.transpose.int, aten.t.default)
def permute(node):
    xs = shape(node.args[0])
    ls = Letters().fresh(len(xs))
    if node.target is aten.permute.default:
        perm = [d % len(xs) for d in node.args[1]]
    else:
        perm = list(range(len(xs)))
        a, b = (node.args[1], node.args[2]) if node.target is aten.transpose.int else (0, len(xs) - 1)
        if xs:
            a, b = a % len(xs), b % len(xs)
            perm[a], perm[b] = perm[b], perm[a]
    return OpSpec("permute", (ls,), ("".join(ls[p] for p in perm),), dict(zip(ls, xs)), partial_inputs=(0,))


@rule(aten.contiguous.default, aten.clone.default, aten._to_copy.default, aten.alias.default,
      aten.detach.default, aten.lift_fresh_copy.default, aten.to.dtype, aten.to.device,
      aten.to.dtype_layout, aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
      aten.full_like.default)
def copy(node):
    spec = _identity(node, "copy")
    if node.target in (aten.ones_like.default, aten.full_like.default):
        return OpSpec(spec.rule, spec.inputs, spec.outputs, spec.sizes, bytes=spec.bytes)   # not linear
    return spec


@rule(aten.type_as.default, aten.to.other)
def type_as(node):
    spec = _identity(node, "copy")
    other = node.args[1]
    # `other` only gives the dtype; sharing letters when shapes match avoids a needless reshard
    if shape(other) == shape(node.args[0]):
        return OpSpec("copy", spec.inputs * 2, spec.outputs, spec.sizes, bytes=spec.bytes, partial_inputs=(0,))
    ls = Letters(spec.inputs[0]).fresh(len(shape(other)))
    sizes = dict(spec.sizes, **dict(zip(ls, shape(other))))
    return OpSpec("copy", (spec.inputs[0], ls), spec.outputs, sizes, unsplittable=frozenset(ls),
                  bytes=spec.bytes, partial_inputs=(0,))


@rule(aten.expand.default)
def expand(node):
    xs, os_ = shape(node.args[0]), shape(node)
    L = Letters()
    out = L.fresh(len(os_))
    sizes, unsplit = dict(zip(out, os_)), set()
    from autopar.rules.ops_matmul import broadcast_letters
    il = broadcast_letters(xs, out, os_, L, sizes, unsplit)
    return OpSpec("expand", (il,), (out,), sizes, unsplittable=frozenset(unsplit), partial_inputs=(0,))


@rule(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int)
def split(node):
    xs = shape(node.args[0])
    ls = Letters().fresh(len(xs))
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    if node.target is aten.unbind.int:
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    dim %= len(xs)
    n = len(val(node))
    out = ls[:dim] + ls[dim + 1:] if node.target is aten.unbind.int else ls
    return OpSpec("split", (ls,), (out,) * n, dict(zip(ls, xs)), unsplittable=frozenset(ls[dim]),
                  partial_inputs=(0,))


@rule(operator.getitem)
def getitem(node):
    v = val(node)
    if not isinstance(v, torch.Tensor) or not isinstance(val(node.args[0]), (tuple, list)):
        return fallback_spec(node, "getitem")
    ls = Letters().fresh(v.dim())
    return OpSpec("getitem", (ls,), (ls,), dict(zip(ls, shape(v))), partial_inputs=(0,))


@rule(aten.cat.default, aten.stack.default)
def cat(node):
    tensors = tensor_inputs(node)
    os_ = shape(node)
    is_stack = node.target is aten.stack.default
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    dim %= len(os_)
    L = Letters()
    out = L.fresh(len(os_))
    sizes, unsplit = dict(zip(out, os_)), {out[dim]}
    ins = []
    for x in tensors:
        if not is_tensor(x) or (not is_stack and shape(x) == (0,)):
            ins.append(None)
            continue
        if is_stack:
            ins.append(out[:dim] + out[dim + 1:])
        else:
            ch = L.fresh()       # each input has its own size along the cat dim
            sizes[ch] = shape(x)[dim]
            unsplit.add(ch)
            ins.append(out[:dim] + ch + out[dim + 1:])
    return OpSpec(node.target.overloadpacket.__name__, tuple(ins), (out,), sizes, unsplittable=frozenset(unsplit),
                  bytes=io_bytes(node), partial_inputs=tuple(range(len(ins))))


@rule(aten.slice.Tensor, aten.select.int)
def slice_select(node):
    xs = shape(node.args[0])
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % len(xs)
    L = Letters()
    ls = L.fresh(len(xs))
    sizes = dict(zip(ls, xs))
    if node.target is aten.select.int:
        out = ls[:dim] + ls[dim + 1:]
        unsplit = {ls[dim]}
    else:
        ch = L.fresh()
        sizes[ch] = shape(node)[dim]
        out = ls[:dim] + ch + ls[dim + 1:]
        unsplit = {ls[dim], ch}
    return OpSpec(node.target.overloadpacket.__name__, (ls,), (out,), sizes, unsplittable=frozenset(unsplit),
                  bytes=io_bytes(node), partial_inputs=(0,))


@rule(aten.index_select.default)
def index_select(node):
    x, dim, index = node.args[0], node.args[1], node.args[2]
    xs = shape(x)
    dim %= len(xs)
    L = Letters("i")
    ls = L.fresh(len(xs))
    sizes = dict(zip(ls, xs), i=shape(index)[0] if shape(index) else 1)
    out = ls[:dim] + "i" + ls[dim + 1:]
    from autopar.rules.spec import Saved
    return OpSpec("index_select", (ls, "i" if shape(index) else ""),
                  (out if shape(index) else ls[:dim] + ls[dim + 1:],),
                  sizes, unsplittable=frozenset(ls[dim]), bytes=io_bytes(node), partial_inputs=(0,),
                  saved=(Saved("input", 1),))


@rule(aten.arange.default, aten.arange.start, aten.arange.start_step, aten.zeros.default, aten.ones.default,
      aten.full.default, aten.scalar_tensor.default, aten.empty.memory_format)
def creation(node):
    # Made on every rank whole: no input to take a layout from, and it is cheap.
    return fallback_spec(node, "creation")


@rule(aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, aten.new_empty.default,
      aten.new_empty_strided.default)
def new_creation(node):
    """``x.new_ones(size)`` and kin: made whole on every rank like the creation ops above. ``x``
    only gives the dtype and device, so it is taken in whatever layout it has (its letters free
    and its own), never gathered for it (a KV-cache step's ``mask.new_ones(rows, 1)``)."""
    L = Letters()
    ls, out = L.fresh(len(shape(node.args[0]))), L.fresh(len(shape(node)))
    sizes = {**dict(zip(ls, shape(node.args[0]))), **dict(zip(out, shape(node)))}
    return OpSpec("creation", (ls,), (out,), sizes, unsplittable=frozenset(out), bytes=io_bytes(node),
                  reduce="ignore")


@rule(aten.repeat_interleave.self_int)
def repeat_interleave(node):
    xs = shape(node.args[0])
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    if dim is None:
        return None     # flattening form: fall back
    dim %= len(xs)
    L = Letters()
    ls = L.fresh(len(xs))
    ch = L.fresh()
    sizes = dict(zip(ls, xs), **{ch: shape(node)[dim]})
    # the repeated dim stays whole; every other dim splits freely (GQA's kv-head expansion)
    return OpSpec("repeat_interleave", (ls,), (ls[:dim] + ch + ls[dim + 1:],), sizes,
                  unsplittable=frozenset({ls[dim], ch}), bytes=io_bytes(node), partial_inputs=(0,))
