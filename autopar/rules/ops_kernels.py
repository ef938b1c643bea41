"""Rules for the fused kernel operators (``torch.ops.autopar.*``, runtime/kernels/ops.py) that
autopar/frontend/fuse.py puts in a traced graph.

* ``autopar.rms_norm(x, weight, eps) -> y`` (rule "rms_norm", a norm to Megatron-SP as ATen's
  is): ``"...h, h -> ...h"``; the normalised dim whole on the rank (the row's mean), the leading
  dims free. One pass reads x and the weight and writes y; autograd keeps x and the weight (the
  backward kernel recomputes rstd).
* ``autopar.swiglu(gate, up) -> silu(gate) * up``: elementwise, every dim free; reads two tensors,
  writes one; keeps gate and up (the unfused pair kept silu's input, the product's two factors).
* ``autopar.layer_norm(x, weight, bias, eps) -> y`` (rule "layer_norm", ATen's name: Megatron-SP
  treats it as the norm it is): ``"...h, h, h -> ...h"``; the normalised dim whole on the rank, the
  leading dims free. One pass reads x, the weight and the bias and writes y; autograd keeps x and
  the weight (the backward recomputes the row statistics).
* ``autopar.geglu(gate, up, approximate) -> gelu(gate) * up``: elementwise as swiglu.
* ``autopar.rotary(x, cos, sin) -> x * cos + rotate_half(x) * sin``: x's leading dims (batch,
  heads, sequence) free, the rotated (head) dim whole on the rank (it pairs i with i + d/2); cos and
  sin broadcast against x as an elementwise op's operands (a size-1 dim of theirs, Hugging Face's
  heads dim, is never split: they are replicated over the heads). One pass reads x, cos and sin
  and writes y; autograd keeps cos and sin, and x only for their gradients.
  ``autopar.rotary_interleaved`` (GPT-J / Meta Llama's pairs, tables of width d/2) the same.
"""
from __future__ import annotations

import math

from runtime.kernels import ops as K

from autopar.rules.ops_matmul import broadcast_letters
from autopar.rules.spec import OpSpec, Saved
from autopar.rules.table import Letters, io_bytes, rule, shape


@rule(K.RMS_NORM)
def rms_norm(node):
    xs = shape(node.args[0])
    L = Letters()
    lead, norm = L.fresh(len(xs) - 1), L.fresh(1)
    sizes = dict(zip(lead + norm, xs))
    return OpSpec("rms_norm", (lead + norm, norm), (lead + norm,), sizes,
                  unsplittable=frozenset(norm), flops=4.0 * math.prod(xs), bytes=io_bytes(node),
                  saved=(Saved("input", 0), Saved("input", 1)))


@rule(K.SWIGLU)
def swiglu(node):
    xs = shape(node.args[0])
    letters = Letters().fresh(len(xs))
    return OpSpec("swiglu", (letters, letters), (letters,), dict(zip(letters, xs)),
                  flops=5.0 * math.prod(xs), bytes=io_bytes(node),
                  saved=(Saved("input", 0), Saved("input", 1)))


@rule(K.LAYER_NORM)
def layer_norm(node):
    xs = shape(node.args[0])
    L = Letters()
    lead, norm = L.fresh(len(xs) - 1), L.fresh(1)
    sizes = dict(zip(lead + norm, xs))
    return OpSpec("layer_norm", (lead + norm, norm, norm), (lead + norm,), sizes,
                  unsplittable=frozenset(norm), flops=8.0 * math.prod(xs), bytes=io_bytes(node),
                  saved=(Saved("input", 0), Saved("input", 1)))


@rule(K.GEGLU)
def geglu(node):
    xs = shape(node.args[0])
    letters = Letters().fresh(len(xs))
    return OpSpec("geglu", (letters, letters), (letters,), dict(zip(letters, xs)),
                  flops=10.0 * math.prod(xs), bytes=io_bytes(node),
                  saved=(Saved("input", 0), Saved("input", 1)))


@rule(K.ROTARY)
def rotary(node):
    xs = shape(node.args[0])
    L = Letters()
    lead, rot = L.fresh(len(xs) - 1), L.fresh(1)
    out = lead + rot
    sizes, unsplit = dict(zip(out, xs)), {rot}
    tables = tuple(broadcast_letters(shape(t), out, xs, L, sizes, unsplit) for t in node.args[1:3])
    return OpSpec("rotary", (out,) + tables, (out,), sizes, unsplittable=frozenset(unsplit),
                  flops=3.0 * math.prod(xs), bytes=io_bytes(node), partial_inputs=(0,),
                  saved=(Saved("input", 1), Saved("input", 2), Saved("input", 0, for_grad_of=(1, 2))))


@rule(K.ROTARY_INTERLEAVED)
def rotary_interleaved(node):
    """``autopar.rotary_interleaved(x, cos, sin)`` (the pairs (2i, 2i + 1), tables of width d/2): as
    rotary, the tables' last dim a letter of its own (d/2), never split."""
    xs = shape(node.args[0])
    L = Letters()
    lead, rot, half = L.fresh(len(xs) - 1), L.fresh(1), L.fresh(1)
    out = lead + rot
    sizes, unsplit = dict(zip(out, xs)), {rot, half}
    sizes[half] = xs[-1] // 2
    tshape = (*xs[:-1], xs[-1] // 2)
    tables = tuple(broadcast_letters(shape(t), lead + half, tshape, L, sizes, unsplit) for t in node.args[1:3])
    return OpSpec("rotary", (out,) + tables, (out,), sizes, unsplittable=frozenset(unsplit),
                  flops=3.0 * math.prod(xs), bytes=io_bytes(node), partial_inputs=(0,),
                  saved=(Saved("input", 1), Saved("input", 2), Saved("input", 0, for_grad_of=(1, 2))))


# softmax, dropout_add (issue 31)
# * ``autopar.softmax(x) -> y``: over the last dim; that dim whole on the rank, every other free.
#   One pass reads x and writes y (memory-bound); autograd keeps y only.
# * ``autopar.dropout_add(x, residual, p, train) -> residual + dropout(x)``: elementwise, every
#   dim free; reads two tensors, writes one; keeps an 8-byte seed when active (the kernel
#   regenerates the mask), nothing when inactive (p == 0 or train False).
@rule(K.SOFTMAX)
def fused_softmax(node):
    xs = shape(node.args[0])
    ls = Letters().fresh(len(xs))
    return OpSpec("softmax", (ls,), (ls,), dict(zip(ls, xs)), unsplittable=frozenset(ls[-1:]),
                  flops=5.0 * math.prod(xs), bytes=io_bytes(node), saved=(Saved("output", 0),))


@rule(K.DROPOUT_ADD)
def fused_dropout_add(node):
    xs = shape(node.args[0])
    letters = Letters().fresh(len(xs))
    p = node.args[2] if len(node.args) > 2 else node.kwargs.get("p", 0.0)
    train = node.args[3] if len(node.args) > 3 else node.kwargs.get("train", True)
    saved = (Saved("extra", letters="", itemsize=8),) if p and train else ()
    return OpSpec("dropout_add", (letters, letters), (letters,), dict(zip(letters, xs)),
                  flops=3.0 * math.prod(xs), bytes=io_bytes(node), saved=saved)


# linear_cross_entropy (issue 31)
# * ``autopar.linear_cross_entropy(hidden, weight, targets, ignore_index, reduction) -> loss``:
#   ``"nd, vd, n -> "`` (reduction 1 mean or 2 sum). The rows (n) split freely: the loss is then a
#   partial sum, a mean run as a local sum over the global count of valid targets as ATen's
#   cross-entropy (autopar/rules/localize.py). d is whole on the rank. The vocabulary (v, the
#   weight's rows) split over a model axis is the vocabulary-parallel kernel (special algorithm
#   "vocab_parallel_lce", runtime/special.py): three all-reduces of one fp32 per row per forward,
#   as vocab-parallel cross-entropy; hidden's gradient comes back partial over that axis (its
#   conjugate all-reduces it). Traffic: the inputs and the loss, no logits. Autograd keeps the
#   gradients the kernel computes in the forward: grad_hidden [n, d] (hidden's dtype) and
#   grad_weight [v, d] (the weight's), each only where that input needs a gradient.
@rule(K.LINEAR_CROSS_ENTROPY)
def linear_cross_entropy(node):
    from autopar.rules.spec import Comm
    from autopar.rules.table import val
    (n, d), (v, _) = shape(node.args[0]), shape(node.args[1])
    sizes = {"n": n, "d": d, "v": v}
    special = {"v": ("vocab_parallel_lce", (Comm("all_reduce", "n", 4),) * 3)}
    hs, ws = (val(a).element_size() for a in node.args[:2])
    return OpSpec("linear_cross_entropy", ("nd", "vd", "n"), ("",), sizes, unsplittable=frozenset("d"),
                  special=special, flops=2.0 * n * v * d + 5.0 * n * v, bytes=io_bytes(node),
                  saved=(Saved("extra", letters="nd", itemsize=hs, act=True, for_grad_of=(0,)),
                         Saved("extra", letters="vd", itemsize=ws, act=True, for_grad_of=(1,))))
