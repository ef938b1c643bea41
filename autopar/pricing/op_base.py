"""What pricing one op needs whatever the micro-batch count and the ZeRO stage, for
``price.price_nodes``: the arithmetic intensity of each rank's contraction (``local_intensity``,
from the letter sizes and splits, ``split_sizes``), whether a strategy splits one micro-batch's
tensors evenly (``divides_micro_batch``), and an op's base terms (``op_base``: local work, saved and
transient bytes, checkpoint-region traffic; kept once per (mesh, precision, device kind))."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from autopar.frontend.batching import global_batch
from autopar.mesh import Mesh
from autopar.pricing.conjugates import region_inputs
from autopar.pricing.cost import gemm_intensity
from autopar.pricing.local_bytes import block_fraction, runtime_itemsize
from autopar.pricing.saved_roots import _saved_roots
from autopar.rules.candidates import FLOAT_DTYPES, Candidates, NodeInfo
from autopar.rules.strategy import Strategy
from autopar.rules.table import shape as tensor_shape
from autopar.rules.table import val as node_val


def op_bytes_scale(val, precision: str) -> float:
    """What an op's ``spec.bytes`` (counted in the traced dtypes, fp32 for a model traced in
    fp32) is multiplied by at run time: under bf16 mixed precision the kernels move bf16
    activations, half those bytes. ``val``: the op's traced output value."""
    v0 = val[0] if isinstance(val, (tuple, list)) and val else val
    return (runtime_itemsize(v0.dtype, precision) / v0.element_size()
            if isinstance(v0, torch.Tensor) and v0.dtype in FLOAT_DTYPES else 1.0)


def has_contraction(spec) -> bool:
    """Two inputs share a letter summed away and each has a letter the other lacks (x·W: b, s
    and n around k; q·k: s and t around d): a GEMM, priced at the GEMM rate for its intensity
    and with a weight-gradient kernel in backward. A letter summed within one input (a sum, a
    mean, an embedding's table rows) or against an index tensor with no letter of its own (a
    loss's targets) is a reduction, not a GEMM (counted as one, cross-entropy would be a GEMM of
    arithmetic intensity 0.5: priced 2.9 ms where it runs in 0.25 ms on these CPUs)."""
    out = set("".join(spec.outputs))
    ins = [set(x) for x in spec.inputs if x]
    for a in range(len(ins)):
        for b in range(a + 1, len(ins)):
            x, y = ins[a], ins[b]
            if (x & y) - out and x - y and y - x:
                return True
    return False


def local_intensity(c: Candidates, spec, info: NodeInfo, j: int, mesh: Mesh, nm: int, itemsize: int) -> float:
    """FLOP/byte of the contraction each rank runs under strategy ``j``: letter sizes divided by
    their splits (and the batch letter by the micro-batch count), for the cost model's
    GEMM-by-intensity curve."""
    cache = c.memo.split_sizes   # c is one mesh's: per (node, strategy)
    got = cache.get((info.node.name, j))
    if got is None:
        got = cache[info.node.name, j] = split_sizes(spec, info, info.strategies[j], mesh)
    sizes, tensors, batch = got
    if nm > 1 and batch:
        sizes = dict(sizes)
        for ch in batch:
            sizes[ch] /= nm
    return gemm_intensity(sizes, tensors, itemsize)


def split_sizes(spec, info: NodeInfo, st: Strategy, mesh: Mesh):
    """(local letter sizes, the letter strings of the operands and result, the batch letters) of
    one strategy: what ``local_intensity`` needs whatever the micro-batch count (the search
    prices each mesh at several counts)."""
    sizes = {ch: float(n) for ch, n in spec.sizes.items()}
    split: dict[str, int] = {}
    for letters, lay in list(zip(spec.inputs, st.inputs)) + list(zip(spec.outputs, st.outputs)):
        if not letters or lay is None or lay.ndim != len(letters):
            continue
        for d, ch in enumerate(letters):
            split[ch] = max(split.get(ch, 1), lay.split_factor(d, mesh.shape))
    for ch, f in split.items():
        if ch in sizes:
            sizes[ch] /= f
    batch = []
    if info.batch_dims and info.batch_dims[0] and spec.outputs:
        for d in info.batch_dims[0]:
            if d < len(spec.outputs[0]) and spec.outputs[0][d] in sizes and spec.outputs[0][d] not in batch:
                batch.append(spec.outputs[0][d])
    used = {ch for t in list(spec.inputs) + list(spec.outputs) if t for ch in t}
    return ({ch: v for ch, v in sizes.items() if ch in used}, [t for t in spec.inputs if t] + list(spec.outputs),
            tuple(ch for ch in batch if ch in used))




def divides_micro_batch(c: Candidates, info: NodeInfo, st: Strategy, nm: int) -> bool:
    """Every layout of the strategy splits one micro-batch's tensors evenly."""
    if nm == 1:
        return True
    shape = c.mesh.shape
    for out, k, n, d in batched_tensors(c, info):
        lay = st.outputs[k] if out else (st.inputs[k] if k < len(st.inputs) else None)
        if lay is None or lay.ndim != n:
            continue
        if (d[1] // nm) % lay.split_factor(d[0], shape):
            return False
    return True


def batched_tensors(c: Candidates, info: NodeInfo) -> list:
    """The tensors a strategy of ``info`` lays out whose size a micro-batch count changes: (is an
    output, index among the outputs / the op's inputs, ndim, (batch dim, its full size)). Only the
    batch dim changes with the count (to its size // count); the full shapes divide by construction
    (a strategy at one micro-batch is valid). Cached per node: pricing asks for every strategy
    at every count."""
    cache = c.memo.batched_tensors
    got = cache.get(info.node.name)
    if got is not None:
        return got
    got = []
    val = node_val(info.node)
    outs = val if isinstance(val, (tuple, list)) else (val,)
    for k, o in enumerate(outs):
        bd = info.batch_dims[k] if k < len(info.batch_dims) else frozenset()
        if isinstance(o, torch.Tensor) and bd:
            d = min(bd)
            got.append((True, k, o.ndim, (d, tensor_shape(o)[d])))
    if info.kind == "op":
        for i, p in enumerate(c.inputs(info.node)):
            prod = c.nodes.get(p.name)
            pv = node_val(p)
            if prod is None or not isinstance(pv, torch.Tensor):
                continue
            bd = prod.batch_dims[0] if prod.batch_dims else frozenset()
            if bd:
                d = min(bd)
                got.append((False, i, pv.ndim, (d, tensor_shape(pv)[d])))
    cache[info.node.name] = got
    return got


@dataclass
class OpBase:
    """What pricing one op's strategies needs that does not depend on the micro-batch count:
    priced once per (mesh, precision, device kind) and divided by each count."""
    wgrad: bool                      # a contraction: backward computes a weight gradient too
    flops: list                      # per strategy, the local work of the whole batch
    nbytes: list
    region: list                     # per strategy, (axis, bytes, batch-carrying) of region_terms
    saved: np.ndarray                # per strategy, saved bytes of the whole batch, one repeat
    saved_by_root: dict              # storage root -> per-strategy share of ``saved``
    fixed_roots: frozenset           # roots of ``saved`` no micro-batch count cuts (``batch_free``)
    transient: np.ndarray            # per strategy, output bytes of the whole batch
    saved_inputs: list               # (input index, root, charged here, bytes of the whole batch)


def op_base(c: Candidates, info: NodeInfo, precision: str, cuda: bool, roots, charged: set) -> OpBase:
    spec = info.spec
    mesh = c.mesh
    val = node_val(info.node)
    bscale = op_bytes_scale(val, precision)
    saved_inputs: list = []
    saved_roots = _saved_roots(c, info, precision, charged, cuda=cuda, roots=roots, saved_inputs=saved_inputs)
    outs = val if isinstance(val, (tuple, list)) else (val,)
    S = len(info.strategies)
    saved, transient = np.zeros(S), np.zeros(S)
    for j, st in enumerate(info.strategies):
        saved[j] = sum(fn(st) for _, fn in saved_roots)
        tb = 0.0
        for o, lay in zip(outs, st.outputs):
            if isinstance(o, torch.Tensor):
                tb += o.numel() * runtime_itemsize(o.dtype, precision) * block_fraction(lay, mesh)
        transient[j] = tb
    return OpBase(
        wgrad=has_contraction(spec),
        flops=[spec.flops * st.work_fraction for st in info.strategies],
        nbytes=[spec.bytes * bscale * st.work_fraction for st in info.strategies],
        region=[region_terms(c, info, st, precision) for st in info.strategies],
        saved=saved, transient=transient,
        saved_by_root={root: np.array([fn(st) for st in info.strategies]) for root, fn in saved_roots
                       if root is not None},
        fixed_roots=frozenset(r for r, _ in saved_roots if r is not None and batch_free(c, r)),
        saved_inputs=saved_inputs)


def batch_free(c: Candidates, root: str) -> bool:
    """Does storage root ``root`` not carry the batch, so a micro-batch count does not cut it? A
    value the op letters give no batch dim and with no dim of the global batch's size: a RoPE
    table from positions ([1, s, d]), a causal mask ([1, 1, s, s]): every micro-batch keeps it whole
    (Hugging Face Llama's cos and sin tables). A value of the batch's size
    the letters missed (a buffer expanded to the batch, BERT's token types) stays cut."""
    memo = c.memo.batch_free
    got = memo.get(root)
    if got is None:
        info = c.nodes.get(root)
        val = node_val(info.node) if info is not None else None
        if c.memo.global_batch is None:
            c.memo.global_batch = global_batch(c.graph, default=1)
        b = c.memo.global_batch
        got = memo[root] = (isinstance(val, torch.Tensor) and not (info.batch_dims and any(info.batch_dims))
                            and b > 1 and b not in tuple(val.shape))
    return got


def region_terms(c: Candidates, info: NodeInfo, st: Strategy, precision: str) -> list:
    """Backward all-reduces of inputs replicated on an axis the op splits its work on (see
    autopar/pricing/conjugates.py), as (axis, bytes of the whole batch, batch-carrying) triples:
    backward runs once per micro-batch, and a batch-carrying tensor is 1/nm of its size each
    time. A parameter's data-axis reduction is its gradient sync, priced with the parameter
    (once per step, not per micro-batch)."""
    mesh = c.mesh
    ins = c.inputs(info.node)
    out = []
    for i, a in region_inputs(st, info.spec.inputs):
        p = ins[i]
        if p.name not in c.needs_grad:
            continue
        if mesh.is_data_axis(a) and c.nodes[p.name].kind == "param":
            continue
        pv = node_val(p)
        if isinstance(pv, (tuple, list)):
            continue
        nb = pv.numel() * runtime_itemsize(pv.dtype, precision) * block_fraction(st.inputs[i], mesh)
        out.append((a, nb, bool(c.nodes[p.name].batch_dims and c.nodes[p.name].batch_dims[0])))
    return out
