"""Rules for contractions: linear, mm, bmm, matmul, addmm, baddbmm, einsum, conv2d.

Contracted letters (k) give a partial-sum output when split; a bias added into the result is
an ``addend_input``: partial on the same axes, so the bias is counted once after the sum.
Autograd saves both operands (measured: linear/addmm save the input and the weight, not the bias).
"""
from __future__ import annotations

import math

import torch

from autopar.rules.spec import OpSpec, Saved
from autopar.rules.table import Letters, io_bytes, is_tensor, rule, shape, tensor_inputs, val

aten = torch.ops.aten


def broadcast_letters(in_shape, out_letters: str, out_shape, L: Letters, sizes: dict,
                      unsplit: set) -> str:
    """Letters of an input broadcast (right-aligned) against an output: matching dims share the
    output letter, size-1 broadcast dims get their own unsplittable letter."""
    off = len(out_shape) - len(in_shape)
    ls = ""
    for d, s in enumerate(in_shape):
        o = d + off
        if s == out_shape[o]:
            ls += out_letters[o]
        else:
            ch = L.fresh()
            sizes[ch] = s
            unsplit.add(ch)
            ls += ch
    return ls


def saved_operands(fn, *xs) -> dict[int, int | None]:
    """What autograd keeps of each tensor ``x`` in ``xs`` when ``fn(*xs)`` runs, for a composite
    op such as ``torch.matmul``, which saves the operands of the bmm/mm it decomposes into:
    ``x.expand(...).reshape(batch, m, k)``. That is a view of x when the reshape can be one and
    a COPY otherwise (heads transposed out of a projection, a broadcast batch dim), and a copy is
    a storage of its own: it is not x's, so it is not shared with whatever else saves x. Returns
    {index: None (x's own storage) or the numel of the copy saved in its place}; an operand
    absent from it is not saved. Found by running ``fn`` under saved_tensors_hooks on meta
    stand-ins with the traced sizes and strides, all needing a gradient (the decomposition is
    the same on every device: matmul is CompositeImplicitAutograd)."""
    leaves = [torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta").requires_grad_()
              for x in xs]
    packed = []
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        fn(*leaves)
    out: dict[int, int | None] = {}
    for t in packed:
        own = [i for i, x in enumerate(leaves) if x.untyped_storage() is t.untyped_storage()]
        if own:
            out.setdefault(own[0], None)
            continue
        # a copy: the leaf its autograd history leads back to is the operand it copies
        reached, seen, todo = set(), set(), [t.grad_fn]
        while todo:
            g = todo.pop()
            if g is None or id(g) in seen:
                continue
            seen.add(id(g))
            var = getattr(g, "variable", None)
            reached |= {i for i, x in enumerate(leaves) if x is var}
            todo += [n for n, _ in g.next_functions]
        if len(reached) == 1:
            out[reached.pop()] = t.numel()
    return out


def operand_saves(fn, xs, letters: list[str], sizes: dict, expanded: list[str] | None = None,
                  index: list[int] | None = None, **kw) -> dict[int, Saved]:
    """{operand: ``Saved``} for ``fn``'s operands ``xs`` (tensor inputs ``index[i]``, default i, of
    the op, with ``letters``) as ``saved_operands`` finds them: the input itself, or a copy of
    its own sized by ``expanded[i]`` (the operand broadcast to the output's batch letters) or its
    own letters, whichever counts its elements; the input where neither does. ``kw``: passed to
    every ``Saved`` (e.g. ``on``)."""
    try:
        found = saved_operands(fn, *xs)
    except Exception:   # not reproducible on meta: every operand as itself
        found = dict.fromkeys(range(len(xs)))
    out = {}
    for i, n in sorted(found.items()):
        cands = ((expanded or [None] * len(xs))[i], letters[i])
        ls = next((ls for ls in cands if ls is not None and n is not None
                   and math.prod(sizes[ch] for ch in ls) == n), None)
        out[i] = (Saved("input", (index or range(len(xs)))[i], **kw) if ls is None
                  else Saved("extra", letters=ls, itemsize=xs[i].element_size(), act=True, **kw))
    return out


@rule(aten.linear.default)
def linear(node):
    x, w = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    xs, (n, k) = shape(x), shape(w)
    L = Letters("kn")
    batch = L.fresh(len(xs) - 1)
    sizes = dict(zip(batch, xs[:-1]), k=k, n=n)
    ins = [batch + "k", "nk"]
    if bias is not None:
        ins.append(broadcast_letters(shape(bias), "n", (n,), L, sizes, set()))
    flops = 2.0 * math.prod(xs[:-1]) * n * k
    return OpSpec("linear", tuple(ins), (batch + "n",), sizes, flops=flops, bytes=io_bytes(node),
                  partial_inputs=() if bias is not None else (0,),
                  addend_inputs=(2,) if bias is not None else (),
                  saved=(Saved("input", 0, for_grad_of=(1,)), Saved("input", 1, for_grad_of=(0,))))


@rule(aten.mm.default)
def mm(node):
    (m, k), (_, n) = shape(node.args[0]), shape(node.args[1])
    return OpSpec("mm", ("mk", "kn"), ("mn",), dict(m=m, k=k, n=n), flops=2.0 * m * n * k,
                  bytes=io_bytes(node), partial_inputs=(0,), saved=(Saved("input", 0), Saved("input", 1)))


@rule(aten.bmm.default)
def bmm(node):
    (b, m, k), (_, _, n) = shape(node.args[0]), shape(node.args[1])
    return OpSpec("bmm", ("bmk", "bkn"), ("bmn",), dict(b=b, m=m, k=k, n=n), flops=2.0 * b * m * n * k,
                  bytes=io_bytes(node), partial_inputs=(0,), saved=(Saved("input", 0), Saved("input", 1)))


@rule(aten.addmm.default, aten.baddbmm.default)
def addmm(node):
    batched = node.target is aten.baddbmm.default
    a, b = shape(node.args[1]), shape(node.args[2])
    sizes = dict(m=a[-2], k=a[-1], n=b[-1])
    out = "mn"
    if batched:
        sizes["b"] = a[0]
        out = "bmn"
    L = Letters("bmkn")
    bias = broadcast_letters(shape(node.args[0]), out, tuple(sizes[c] for c in out), L, sizes, unsplit := set())
    flops = 2.0 * math.prod(sizes[c] for c in "bmkn" if c in sizes)
    return OpSpec(node.target.overloadpacket.__name__, (bias, out[:-1] + "k", out[:-2] + "kn"), (out,), sizes,
                  unsplittable=frozenset(unsplit), flops=flops, bytes=io_bytes(node),
                  addend_inputs=(0,), saved=(Saved("input", 1), Saved("input", 2)))


@rule(aten.matmul.default)
def matmul(node):
    a, b = shape(node.args[0]), shape(node.args[1])
    out_shape = shape(node)
    L = Letters("mkn")
    sizes, unsplit = {"k": a[-1]}, set()
    nbatch = len(out_shape) - (len(a) >= 2) - (len(b) >= 2)
    batch = L.fresh(nbatch)
    sizes.update(zip(batch, out_shape[:nbatch]))
    out = batch + ("m" if len(a) >= 2 else "") + ("n" if len(b) >= 2 else "")
    if len(a) >= 2:
        sizes["m"] = a[-2]
    if len(b) >= 2:
        sizes["n"] = b[-1]
    ins = []
    for s, tail in ((a, "mk" if len(a) >= 2 else "k"), (b, "kn" if len(b) >= 2 else "k")):
        lead = s[:len(s) - len(tail)]
        ins.append(broadcast_letters(lead, batch, out_shape[:nbatch], L, sizes, unsplit) + tail)
    flops = 2.0 * math.prod(out_shape) * a[-1]
    # the bmm operands: each input broadcast to the output's batch letters, then flattened
    expanded = [batch + ls[len(ls) - len(tail):] for ls, tail in
                zip(ins, ("mk" if len(a) >= 2 else "k", "kn" if len(b) >= 2 else "k"))]
    saved = tuple(operand_saves(torch.matmul, [val(x) for x in node.args[:2]], ins, sizes, expanded).values())
    return OpSpec("matmul", tuple(ins), (out,), sizes, unsplittable=frozenset(unsplit), flops=flops,
                  bytes=io_bytes(node), partial_inputs=(0,), saved=saved)


@rule(aten.einsum.default)
def einsum(node):
    eq = node.args[0].replace(" ", "")
    ops = tensor_inputs(node)
    if "..." in eq:
        return None     # ellipsis einsums fall back to replicate
    lhs, _, rhs = eq.partition("->")
    terms = lhs.split(",")
    if not _ or any(len(set(t)) != len(t) for t in terms) or len(terms) != len(ops):
        return None     # implicit output or diagonals: fall back
    sizes = {}
    for t, x in zip(terms, ops):
        sizes.update(zip(t, shape(x)))
    # Letters of size 1 in one operand but not another are broadcasts: keep them whole.
    unsplit = {c for t, x in zip(terms, ops) for c, s in zip(t, shape(x)) if s != sizes[c]}
    flops = 2.0 * math.prod(sizes.values()) if len(ops) > 1 else float(math.prod(sizes.values()))
    return OpSpec("einsum", tuple(terms), (rhs,), sizes, unsplittable=frozenset(unsplit), flops=flops,
                  bytes=io_bytes(node), partial_inputs=(0,) if len(ops) <= 2 else (),
                  saved=tuple(Saved("input", i) for i in range(len(ops))))


@rule(aten.conv2d.default)
def conv2d(node):
    x, w = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    groups = node.args[6] if len(node.args) > 6 else node.kwargs.get("groups", 1)
    (b, c, h, wd), (o, _, kh, kw) = shape(x), shape(w)
    _, _, oh, ow = shape(node)
    sizes = dict(b=b, c=c, h=h, w=wd, o=o, y=kh, z=kw, p=oh, q=ow)
    # Spatial dims need halos and kernel dims are whole; with groups the channel blocks couple.
    unsplit = {"h", "w", "y", "z", "p", "q"} | ({"c", "o"} if groups != 1 else set())
    ins = ["bchw", "ocyz"]
    if bias is not None and is_tensor(bias):
        ins.append("o")
    flops = 2.0 * b * o * oh * ow * (c // groups) * kh * kw
    return OpSpec("conv2d", tuple(ins), ("bopq",), sizes, unsplittable=frozenset(unsplit), flops=flops,
                  bytes=io_bytes(node), partial_inputs=() if len(ins) > 2 else (0,),
                  addend_inputs=(2,) if len(ins) > 2 else (), saved=(Saved("input", 0), Saved("input", 1)))
