"""Rules for elementwise ops (unary and broadcasting n-ary) and reductions.

Broadcasting is right-aligned: an input dim equal to the output dim shares its letter; a
size-1 broadcast dim gets its own unsplittable letter. Linearity decides partial pass-through:
add/sub of tensors is linear in all inputs; mul/div by a non-partial tensor is linear in the
other; an op with a Python-number addend (x + 1) is affine, not linear, so no partial inputs.
Reductions contract the reduced letters: sum/mean give partial sums (a local mean is rescaled
by local/global count in ``localize``); amax/amin may not split them.
"""
from __future__ import annotations

import math

import torch

from autopar.rules.ops_matmul import broadcast_letters
from autopar.rules.spec import OpSpec, Saved
from autopar.rules.table import Letters, io_bytes, is_tensor, rule, shape, tensor_inputs, val

aten = torch.ops.aten

# unary op -> what autograd saves ("input", "output" or None), measured on CPU
UNARY = {
    aten.gelu: "input", aten.silu: "input", aten.relu: "output", aten.tanh: "output",
    aten.sigmoid: "output", aten.neg: None, aten.rsqrt: "output", aten.exp: "output",
    aten.sqrt: "output", aten.log: "input", aten.sin: "input", aten.cos: "input",
    aten.abs: "input", aten.reciprocal: "output", aten.erf: "input", aten.square: "input",
    aten.logical_not: None,
}
LINEAR_UNARY = {aten.neg}


def _elementwise_spec(node, name, linear_in=(), saved=()):
    out_shape = shape(node)
    L = Letters()
    out = L.fresh(len(out_shape))
    sizes, unsplit = dict(zip(out, out_shape)), set()
    ins = []
    for x in tensor_inputs(node):
        ins.append(broadcast_letters(shape(x), out, out_shape, L, sizes, unsplit) if is_tensor(x) else None)
    return OpSpec(name, tuple(ins), (out,), sizes, unsplittable=frozenset(unsplit),
                  flops=float(math.prod(out_shape)), bytes=io_bytes(node), partial_inputs=tuple(linear_in),
                  saved=tuple(saved))


@rule(*UNARY)
def unary(node):
    what = UNARY[node.target.overloadpacket]
    saved = (Saved(what, 0),) if what else ()
    lin = (0,) if node.target.overloadpacket in LINEAR_UNARY else ()
    return _elementwise_spec(node, node.target.overloadpacket.__name__, lin, saved)


def _tensor_operands(node):
    """Positions (in args) of tensor operands and whether every operand is a tensor."""
    ops = [a for a in node.args[:2]]
    return [i for i, a in enumerate(ops) if is_tensor(a)], all(is_tensor(a) for a in ops)


@rule(aten.add, aten.sub)
def add_sub(node):
    tens, all_tensors = _tensor_operands(node)
    # x + y of partial sums is the partial sum of x + y; x + 1 is not (the 1 would be added n times)
    lin = tuple(range(len(tens))) if all_tensors and len(node.args) >= 2 else ()
    return _elementwise_spec(node, node.target.overloadpacket.__name__, lin)


@rule(aten.mul, aten.div)
def mul_div(node):
    tens, _ = _tensor_operands(node)
    is_div = node.target.overloadpacket is aten.div
    if len(tens) == 2:
        if is_div:
            lin = (0,)
        else:    # linear in either factor: let the bigger one (the activation) be the partial one
            a, b = (math.prod(shape(node.args[i])) for i in (0, 1))
            lin = (0,) if a >= b else (1,)
        # autograd keeps each factor only for the other's gradient; div keeps the divisor for both
        saved = (Saved("input", 0, for_grad_of=(1,)), Saved("input", 1, for_grad_of=(0, 1) if is_div else (0,)))
    else:
        lin, saved = (0,), ()
    return _elementwise_spec(node, node.target.overloadpacket.__name__, lin, saved)


@rule(aten.pow.Tensor_Scalar)
def pow_scalar(node):
    return _elementwise_spec(node, "pow", (), (Saved("input", 0),))


@rule(aten.maximum, aten.minimum)
def max_min(node):
    return _elementwise_spec(node, node.target.overloadpacket.__name__, (), (Saved("input", 0), Saved("input", 1)))


@rule(aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge, aten.logical_and, aten.logical_or,
      aten.__and__, aten.__or__, aten.bitwise_and, aten.bitwise_or)
def compare(node):
    return _elementwise_spec(node, "compare")


@rule(aten.where.self)
def where(node):
    ins = tensor_inputs(node)
    # linear in (a, b) jointly when both are tensors; the condition is saved for backward
    lin = (1, 2) if len(ins) == 3 else ()
    return _elementwise_spec(node, "where", lin, (Saved("input", 0),))


@rule(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def masked_fill(node):
    value = node.args[2]
    lin = (0,) if (not is_tensor(value) and value == 0) else ()   # filling zeros keeps sums exact
    return _elementwise_spec(node, "masked_fill", lin, (Saved("input", 1),))


# ---------------------------------------------------------------- reductions

def _reduced_dims(node, ndim):
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return sorted(d % ndim for d in dims) if ndim else []


@rule(aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.mean.default, aten.amax.default,
      aten.amin.default)
def reduction(node):
    x = node.args[0]
    xs = shape(x)
    name = node.target.overloadpacket.__name__
    default = node.target in (aten.sum.default, aten.mean.default)
    dims = list(range(len(xs))) if default else _reduced_dims(node, len(xs))
    keep = (node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)) and not default
    L = Letters()
    ls = L.fresh(len(xs))
    sizes, unsplit = dict(zip(ls, xs)), set()
    out = ""
    for d, ch in enumerate(ls):
        if d not in dims:
            out += ch
        elif keep:
            k = L.fresh()
            sizes[k] = 1
            unsplit.add(k)
            out += k
    maxlike = name in ("amax", "amin")
    return OpSpec(name, (ls,), (out,), sizes, unsplittable=frozenset(unsplit),
                  reduce="none" if maxlike else "sum", flops=float(math.prod(xs)), bytes=io_bytes(node),
                  partial_inputs=() if maxlike else (0,),
                  saved=(Saved("input", 0), Saved("output", 0)) if maxlike else ())


def mean_count(node) -> int:
    """Elements averaged per output element of a mean reduction (for tests and localize)."""
    xs = shape(node.args[0])
    return math.prod(xs) // max(1, val(node).numel())
