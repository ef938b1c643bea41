"""Rules for neural-network ops: embedding, layer/RMS norm, softmax, attention, dropout, losses.

Saved tensors follow autograd (measured with saved_tensors_hooks; where CUDA and CPU kernels
differ both are listed, tagged ``on=``): layer_norm saves input, weight, bias, mean and rstd
(fp32, one per row); rms_norm saves input, weight, rstd and the normalised input;
softmax/log_softmax their output; dropout a 1-byte bool mask on CUDA (native_dropout), a mask in
the working dtype on CPU; SDPA on CUDA (flash / efficient / cuDNN) and on CPU without dropout q,
k, v, output and the fp32 logsumexp (plus the mask), on CPU with dropout the math path's
intermediates; cross_entropy the log-softmax, the target and a scalar total weight.
"""
from __future__ import annotations

import math

import torch

from autopar.rules.ops_matmul import broadcast_letters, operand_saves
from autopar.rules.spec import Comm, OpSpec, Saved
from autopar.rules.table import Letters, io_bytes, is_tensor, rule, shape, val

aten = torch.ops.aten


def _arg(node, i, name, default=None):
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _itemsize(x) -> int:
    return val(x).element_size()


@rule(aten.embedding.default)
def embedding(node):
    w, idx = node.args[0], node.args[1]
    v, h = shape(w)
    L = Letters("vh")
    il = L.fresh(len(shape(idx)))
    sizes = dict(zip(il, shape(idx)), v=v, h=h)
    # Splitting the vocab makes each rank look up only its rows: a partial sum (zeros for the
    # rows it does not own) that resharding resolves; the masking is the codegen's algorithm.
    return OpSpec("embedding", ("vh", il), (il + "h",), sizes, bytes=io_bytes(node),
                  special={"v": ("vocab_parallel_embedding", ())}, saved=(Saved("input", 1),))


def _norm_letters(node, nnorm):
    xs = shape(node.args[0])
    L = Letters()
    lead = L.fresh(len(xs) - nnorm)
    norm = L.fresh(nnorm)
    sizes = dict(zip(lead + norm, xs))
    return lead, norm, sizes


@rule(aten.layer_norm.default)
def layer_norm(node):
    nshape = list(node.args[1])
    lead, norm, sizes = _norm_letters(node, len(nshape))
    ins = [lead + norm]
    saved = [Saved("input", 0)]
    for i, name in ((2, "weight"), (3, "bias")):
        if is_tensor(_arg(node, i, name)):
            saved.append(Saved("input", len(ins)))
            ins.append(norm)
    saved += [Saved("extra", letters=lead, itemsize=4), Saved("extra", letters=lead, itemsize=4)]
    return OpSpec("layer_norm", tuple(ins), (lead + norm,), sizes, unsplittable=frozenset(norm),
                  flops=8.0 * math.prod(sizes.values()), bytes=io_bytes(node), saved=tuple(saved))


@rule(aten.rms_norm.default)
def rms_norm(node):
    nshape = list(node.args[1])
    lead, norm, sizes = _norm_letters(node, len(nshape))
    ins = [lead + norm]
    isz = _itemsize(node.args[0])
    saved = [Saved("input", 0)]
    if is_tensor(_arg(node, 2, "weight")):
        saved.append(Saved("input", 1))
        ins.append(norm)
    saved += [Saved("extra", letters=lead, itemsize=isz), Saved("extra", letters=lead + norm, itemsize=isz)]
    return OpSpec("rms_norm", tuple(ins), (lead + norm,), sizes, unsplittable=frozenset(norm),
                  flops=5.0 * math.prod(sizes.values()), bytes=io_bytes(node), saved=tuple(saved))


@rule(aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default)
def softmax(node):
    xs = shape(node.args[0])
    ls = Letters().fresh(len(xs))
    dim = node.args[1] % max(len(xs), 1)
    return OpSpec(node.target.overloadpacket.__name__, (ls,), (ls,), dict(zip(ls, xs)),
                  unsplittable=frozenset(ls[dim] if xs else ""), flops=5.0 * math.prod(xs),
                  bytes=io_bytes(node), saved=(Saved("output", 0),))


@rule(aten.scaled_dot_product_attention.default)
def sdpa(node):
    q, k, v = node.args[:3]
    mask = _arg(node, 3, "attn_mask")
    dropout_p = _arg(node, 4, "dropout_p", 0.0)
    causal = _arg(node, 5, "is_causal", False)
    (b, h, s, d), (_, hk, t, _), e = shape(q), shape(k), shape(v)[-1]
    sizes = dict(b=b, h=h, s=s, d=d, t=t, e=e)
    unsplit = {"t", "d", "e"}
    # A causal mask is relative to the global query position: a local query block would need a
    # shifted mask, so the query sequence stays whole under is_causal (ring attention is its own
    # algorithm).
    if causal:
        unsplit.add("s")
    kh = "h"
    if hk != h:      # grouped-query attention: head blocks of q and kv do not line up simply
        kh = "g"
        sizes["g"] = hk
        unsplit |= {"h", "g"}
    ins = ["bhsd", "b" + kh + "td", "b" + kh + "te"]
    if is_tensor(mask):
        L = Letters("bhsdteg")
        ins.append(broadcast_letters(shape(mask), "bhst", (b, h, s, t), L, sizes, unsplit))
    isz = _itemsize(q)
    # A fused kernel (CUDA: flash / memory-efficient / cuDNN, dropout or not; CPU: flash without
    # dropout) saves q, k, v, the output and the fp32 logsumexp, plus the mask it was given; a
    # bool mask is converted to q's dtype and that copy is saved. With dropout CUDA also keeps
    # its RNG seed and offset (two 8-byte scalars), not a mask.
    fused = (Saved("input", 0), Saved("input", 1), Saved("input", 2), Saved("output", 0),
             Saved("extra", letters="bhs", itemsize=4))
    if is_tensor(mask):
        fused += ((Saved("input", 3),) if val(mask).dtype == val(q).dtype
                  else (Saved("extra", letters=ins[3], itemsize=isz, act=True),))
    cuda = tuple(Saved(sv.kind, sv.index, sv.letters, sv.itemsize, act=sv.act, on="cuda") for sv in fused)
    if dropout_p:
        cuda += (Saved("extra", itemsize=8, on="cuda"),) * 2
        # CPU with dropout runs the math path: k^T and the scaled q (as bmm operands), the
        # attention weights, the dropout mask, the dropped weights and v. k and v with fewer
        # heads are repeated to q's first (copies with h heads). k^T and q are scaled copies;
        # v is saved as the dropped weights @ v matmul saves it: v's own storage when its bmm
        # operand is a view of it, else a copy (v transposed out of a fused qkv projection).
        # Under a 16-bit working dtype it upcasts to fp32 and saves fp32 copies, v included.
        math_path = ("bhtd", "bhsd", "bhst", "bhst", "bhst")
        v32 = Saved("extra", letters="bhte", itemsize=isz, act=True, on="cpu32")
        if kh == "h":
            probs = torch.empty((b, h, s, t), dtype=val(v).dtype, device="meta")
            v32 = operand_saves(torch.matmul, [probs, val(v)], ["bhst", "bhte"], sizes,
                                index=[None, 2], on="cpu32").get(1, v32)
        cpu = ((v32,) + tuple(Saved("extra", letters=ls, itemsize=isz, on="cpu32") for ls in math_path)
               + tuple(Saved("extra", letters=ls, itemsize=4, on="cpu16") for ls in math_path + ("bhte",)))
    else:
        cpu = tuple(Saved(sv.kind, sv.index, sv.letters, sv.itemsize, act=sv.act, on="cpu") for sv in fused)
    saved = cuda + cpu
    # The output's memory layout: flash attention (CUDA in 16 bits without a mask, CPU without
    # dropout) lays it out like q, memory-efficient attention (CUDA otherwise) as (b, s, h, e); with
    # q a view of a (b, s, 3, h, d) projection the usual ``y.transpose(1, 2).reshape(b, s, h*e)``
    # is then a view, not a copy. The math path (CPU with dropout, and the trace on meta) writes it
    # contiguously.
    order = ((("cuda16", "=0"),) if not is_tensor(mask) else ()) + (("cuda", "bshe"),) \
        + ((("cpu", "=0"),) if not dropout_p else ())
    return OpSpec("sdpa", tuple(ins), ("bhse",), sizes, unsplittable=frozenset(unsplit),
                  flops=2.0 * b * h * s * t * (d + e), bytes=io_bytes(node), saved=saved, storage_order=order)


@rule(aten.dropout.default, aten.native_dropout.default)
def dropout(node):
    xs = shape(node.args[0])
    ls = Letters().fresh(len(xs))
    p, train = node.args[1], node.args[2]
    native = node.target is aten.native_dropout.default
    active = bool(train) and p > 0
    if native:
        outs, saved = (ls, ls), (Saved("output", 1),)
    else:
        # CUDA runs F.dropout as native_dropout, which saves a bool mask (1 byte); CPU (and meta)
        # computes x * mask and saves the mask in x's working dtype (2 bytes under bf16).
        outs = (ls,)
        saved = (Saved("extra", letters=ls, itemsize=1, on="cuda"),
                 Saved("extra", letters=ls, itemsize=_itemsize(node.args[0]), act=True, on="cpu")) if active else ()
    identity = not active and not native   # returns x itself: no kernel runs, priced as a view
    return OpSpec("dropout", (ls,), outs, dict(zip(ls, xs)), flops=0.0 if identity else float(math.prod(xs)),
                  bytes=0 if identity else io_bytes(node), saved=saved,
                  # an inactive dropout is the identity: linear, so partial sums pass through,
                  # and it returns x itself (no copy), so what is saved of its output is x's storage
                  partial_inputs=(0,) if not active else (),
                  returns_input=0 if identity else None)


def _loss_letters(node):
    """Letters of (input, target): class dim 1 of an N-D input (or dim 0 of a 1-D one)."""
    xs = shape(node.args[0])
    L = Letters("v")
    if len(xs) == 1:
        return "v", "", {"v": xs[0]}
    rest = L.fresh(len(xs) - 1)
    x = rest[0] + "v" + rest[1:]
    return x, rest, dict(zip(x, xs))


@rule(aten.cross_entropy_loss.default)
def cross_entropy(node):
    x, tgt, sizes = _loss_letters(node)
    weight = _arg(node, 2, "weight")
    reduction = _arg(node, 3, "reduction", 1)
    smoothing = _arg(node, 5, "label_smoothing", 0.0)
    ins = [x, tgt]
    unsplit, special = set(), {}
    if is_tensor(weight):
        ins.append("v")
    if is_tensor(weight) or smoothing:
        unsplit.add("v")    # the distributed formula below covers the plain loss only
    else:
        # Vocab-parallel CE: all-reduce the row max, the sum of exponentials and the target logit
        # (one fp32 per row each); the algorithm leaves every rank with the full per-row loss.
        special["v"] = ("vocab_parallel_ce", (Comm("all_reduce", tgt, 4),) * 3)
    out = tgt if reduction == 0 else ""
    n = math.prod(sizes.values())
    # traffic: the inputs and the loss, plus the log-softmax it writes (eager cross-entropy is
    # log_softmax then nll_loss; the log-softmax is also what it saves for backward)
    logits = val(node.args[0])
    lsm = logits.numel() * logits.element_size() if isinstance(logits, torch.Tensor) else 0
    return OpSpec("cross_entropy", tuple(ins), (out,), sizes, unsplittable=frozenset(unsplit),
                  special=special, flops=5.0 * n, bytes=io_bytes(node) + lsm,
                  saved=(Saved("extra", letters=x, itemsize=_itemsize(node.args[0]), act=True), Saved("input", 1),
                         Saved("extra", letters="", itemsize=4)))


@rule(aten.nll_loss.default)
def nll_loss(node):
    x, tgt, sizes = _loss_letters(node)
    weight = _arg(node, 2, "weight")
    reduction = _arg(node, 3, "reduction", 1)
    ins = [x, tgt] + (["v"] if is_tensor(weight) else [])
    out = tgt if reduction == 0 else ""
    # Splitting the class dim would need the target re-indexed per rank: kept whole.
    return OpSpec("nll_loss", tuple(ins), (out,), sizes, unsplittable=frozenset("v"),
                  flops=float(math.prod(shape(node.args[1]) or (1,))), bytes=io_bytes(node),
                  partial_inputs=(0,),
                  saved=(Saved("input", 0), Saved("input", 1), Saved("extra", letters="", itemsize=4)))
